"""The shared Tier conformance suite on the NVMe tier, on both IO backends.

Media hooks: the log file is the media. A crash image is a copy of it taken while the tier is
open; an entry is found by walking the log as `formats.nvme_layout` defines it (superblock, region
headers, entry prefixes packed at the log's granularity, padding records, object headers),
bypassing the tier.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from tests._media import flip_payload_bytes
from tests.tiers._nvme_support import nvme_config
from tierkv._platform import io_uring_sqpoll_available
from tierkv.config import NvmeBackend
from tierkv.errors import CorruptObjectError
from tierkv.formats.header import decode_header
from tierkv.formats.nvme_layout import (
    PADDING,
    PREFIX,
    SUPERBLOCK_SIZE,
    TOMBSTONE,
    align_up,
    decode_prefix,
    decode_region_header,
    decode_superblock,
)
from tierkv.testing import TierConformance
from tierkv.tiers.base import Tier
from tierkv.tiers.nvme.tier import NvmeTier

LOG = "tier.log"


def payload_offsets(media: bytes, key: bytes) -> list[int]:
    """File offsets of the payloads of every entry of `key` in the log's bytes."""
    sb = decode_superblock(media[:SUPERBLOCK_SIZE])
    view = memoryview(media)
    found = []
    for index in range(sb.region_count):
        base = sb.region_offset(index)
        seq = decode_region_header(view[base : base + sb.alignment], sb.uuid, index)
        offset = sb.alignment
        while seq is not None and offset + PREFIX.size <= sb.region_size:
            prefix = decode_prefix(view, base + offset, sb.uuid)
            if prefix is None or prefix.seq != seq:
                break  # the end of this use of the region
            body = base + offset + PREFIX.size
            offset += align_up(PREFIX.size + prefix.body_len, sb.granularity)
            if prefix.flags & PADDING:
                continue  # fills a block up to its end at a flush: no entry
            try:
                header, length = decode_header(view[body : body + prefix.body_len])
            except CorruptObjectError:
                break
            if header.key == key and not prefix.flags & TOMBSTONE and header.payload_length:
                found.append(body + length)
    return found


class NvmeMedia(TierConformance):
    """The media hooks of every NVMe conformance class."""

    def crash_image(self, directory: Path, into: Path) -> None:
        shutil.copyfile(directory / LOG, into / LOG)

    def corrupt_payload(self, directory: Path, key: bytes) -> None:
        flip_payload_bytes(directory / LOG, key, payload_offsets)


@pytest.mark.uring
class TestNvmeUring(NvmeMedia):
    async def make_tier(self, directory: Path) -> Tier:
        return NvmeTier(nvme_config(directory, backend=NvmeBackend.IO_URING))

    async def test_backend_in_use(self, tier: Tier) -> None:
        assert tier.stats()["backend"] == "io_uring"
        assert tier.describe()["backend"] == "io_uring"


class TestNvmeThreads(NvmeMedia):
    async def make_tier(self, directory: Path) -> Tier:
        return NvmeTier(nvme_config(directory, backend=NvmeBackend.THREADS))

    async def test_backend_in_use(self, tier: Tier) -> None:
        assert tier.stats()["backend"] == "threads"
        assert tier.describe()["backend"] == "threads"

    @pytest.mark.direct
    async def test_io_is_direct(self, tier: Tier) -> None:
        assert tier.describe()["io"].startswith("direct")


@pytest.mark.uring
class TestNvmeUringSqPoll(NvmeMedia):
    """The same contract with io_uring submission-queue polling (`sq_poll`)."""

    async def make_tier(self, directory: Path) -> Tier:
        reason = io_uring_sqpoll_available()
        if reason is not None:
            pytest.skip(f"sq_poll: {reason}")
        config = nvme_config(directory, backend=NvmeBackend.IO_URING)
        return NvmeTier(dataclasses.replace(config, sq_poll=0.002))

    async def test_backend_in_use(self, tier: Tier) -> None:
        assert tier.stats()["backend"] == "io_uring"
        assert tier.stats()["sq_poll"] == 0.002
        assert "2ms" in tier.describe()["sq_poll"]
