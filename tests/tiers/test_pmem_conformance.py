"""The shared Tier conformance suite against `PmemTier` (pool file under the test's tmp_path).

Media hooks: the pool file is the media. A crash image is a copy of it taken while the tier is
open (its mapping is shared with the file, so the copy holds what a killed process leaves); a
record is found by scanning the file for record prefixes and decoding them (`formats.pmem_layout`),
without PMDK, so nothing but the bytes is trusted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests._media import flip_payload_bytes
from tierkv.config import PmemTierConfig
from tierkv.errors import CorruptObjectError
from tierkv.formats import pmem_layout as layout
from tierkv.testing import TierConformance
from tierkv.tiers.base import Tier
from tierkv.tiers.pmem.tier import PmemTier

pytestmark = pytest.mark.pmem

CAPACITY = 8 << 20
POOL = "tier.pool"


def payload_offsets(media: bytes, key: bytes) -> list[int]:
    """File offsets of the payloads of every record of `key` in the pool file's bytes."""
    found = []
    view = memoryview(media)
    at = media.find(layout.RECORD_MAGIC)
    while at >= 0:
        try:
            info = layout.decode_record(view[at:])
        except CorruptObjectError:
            pass  # the magic inside other bytes, or a record's remains
        else:
            if info.header.key == key and info.header.payload_length:
                found.append(at + info.payload_offset)
        at = media.find(layout.RECORD_MAGIC, at + 1)
    return found


def flip_payload_byte(path: Path, key: bytes) -> None:
    """Flip the bits of one byte of the payload of every record of `key` in the pool file."""
    flip_payload_bytes(path, key, payload_offsets)


class PmemMedia(TierConformance):
    """The media hooks of every pmem conformance class."""

    def crash_image(self, directory: Path, into: Path) -> None:
        shutil.copyfile(directory / POOL, into / POOL)

    def corrupt_payload(self, directory: Path, key: bytes) -> None:
        flip_payload_byte(directory / POOL, key)


class TestPmemConformance(PmemMedia):
    async def make_tier(self, directory: Path) -> Tier:
        return PmemTier(PmemTierConfig("pmem", CAPACITY, directory / POOL))

    @pytest.mark.native
    async def test_copies_are_native(self, tier: Tier) -> None:
        assert tier.stats()["copy_path"].startswith("native")


class TestPmemConformancePythonCopies(PmemMedia):
    """The same contract on the Python copy path (what runs where the native library is not
    built)."""

    async def make_tier(self, directory: Path) -> Tier:
        return PmemTier(PmemTierConfig("pmem", CAPACITY, directory / POOL), native=False)

    async def test_copies_are_python(self, tier: Tier) -> None:
        assert tier.stats()["copy_path"] == "python"
