"""The regions the NVMe log keeps free for its checkpoint: a full log writes it at close.

A log filled until it reclaims regions still has room for the checkpoint of what it holds, so
the next open loads it instead of scanning; the reservation follows the index as it grows (more
and smaller entries), `capacity` leaves it out, and a log too small for it (two regions) keeps
none and scans as before. The bound the reservation is sized by is checked against the
checkpoint encoder itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers._nvme_support import REGION, flip_byte, key, meta_of, nvme_config, payload_for
from tierkv.config import RegionEviction
from tierkv.formats.nvme_layout import (
    SUPERBLOCK_SIZE,
    Checkpoint,
    CheckpointEntry,
    CheckpointRegion,
    decode_superblock,
    encode_checkpoint,
)
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme._index import NvmeIndex
from tierkv.tiers.nvme._regions import RegionState, RegionTable
from tierkv.tiers.nvme._reserve import CheckpointReserve, meta_weight
from tierkv.tiers.nvme.tier import NvmeTier

TIER_LOG = "tierkv.tiers.nvme.tier"


async def _fill(tier: NvmeTier, keys: range, size: int) -> None:
    """Put `keys`, each with its own `size`-byte payload; checks the space accounting now and
    then (what is used fits in `capacity`, which leaves out the regions kept free)."""
    regions = int(tier.describe()["regions"])
    for n, i in enumerate(keys):
        data = payload_for(i, size)
        await tier.put(key(i), meta_of(data), memoryview(data))
        if n % 101 == 0:
            stats = tier.stats()
            assert tier.used <= tier.capacity
            assert tier.capacity == (regions - stats["regions_reserved"]) * REGION
            assert stats["regions_free"] >= stats["regions_reserved"]


async def _reopen_and_compare(config_path: Path, regions: int, held: dict[bytes, int],
                              size_of: dict[bytes, int]) -> NvmeTier:
    """Reopen the log; it must come back from the checkpoint with exactly `held`."""
    again = NvmeTier(nvme_config(config_path, regions=regions))
    await again.open()
    assert again.stats()["recovered_from"] == "checkpoint"
    assert set(again.keys()) == set(held)
    for k in sorted(held)[:: max(len(held) // 20, 1)]:  # a few values, byte for byte
        got = await again.get(k)
        assert got is not None
        assert payload_bytes(got[1]) == payload_for(held[k], size_of[k])
    return again


def _regions_stats(tier: NvmeTier) -> tuple[int, int, int]:
    stats = tier.stats()
    return stats["regions_reserved"], stats["regions_free"], stats["regions_reclaimed"]


@pytest.mark.parametrize("eviction", [RegionEviction.FIFO, RegionEviction.LRU])
@pytest.mark.parametrize("size", [4000, 16], ids=["4000B", "16B"])
async def test_a_full_log_writes_its_checkpoint_at_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, size: int, eviction: RegionEviction
) -> None:
    """Eight regions filled twice over (4000-byte objects: one region kept for the checkpoint;
    16-byte ones: several, as the index holds some 60,000 entries) and closed: close writes
    the checkpoint, the reopen loads it with every key the tier held, values intact."""
    regions = 8
    count = 2 * regions * (REGION // (size + 100))
    tier = NvmeTier(nvme_config(tmp_path, regions=regions, eviction=eviction))
    await tier.open()
    try:
        await _fill(tier, range(count), size)
        reserved, free, reclaimed = _regions_stats(tier)
        assert reclaimed >= regions  # full: the log reclaimed regions all along
        assert 1 <= reserved <= free
        assert reserved > 1 or size > 100  # tiny entries: the checkpoint takes more than one
        held = {k: int(k.rsplit(b"-", 1)[1]) for k in list(tier.keys())}
    finally:
        with caplog.at_level(logging.WARNING, logger=TIER_LOG):
            await tier.close()
    assert tier.stats()["checkpoint_skipped"] == 0
    assert not [r for r in caplog.records if r.name == TIER_LOG and r.levelno >= logging.WARNING]
    again = await _reopen_and_compare(tmp_path, regions, held, dict.fromkeys(held, size))
    await again.close()


async def test_the_reservation_grows_with_the_index(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A log full of 16 KiB objects (one region kept) then filled with tiny ones: the index
    grows many times over and the log reclaims regions into FREE as the checkpoint needs
    them (``reserve_reclaims``); close still writes it, and a scan of the same media (the
    checkpoint damaged) brings back nothing those reclaims dropped."""
    regions = 8
    tier = NvmeTier(nvme_config(tmp_path, regions=regions, reinsert_hits=0))
    await tier.open()
    big = range(0, 2 * regions * 63)
    small = range(100_000, 100_000 + 3 * regions * (REGION // 256))
    size_of = {**{key(i): 16384 for i in big}, **{key(i): 16 for i in small}}
    try:
        await _fill(tier, big, 16384)
        assert tier.stats()["regions_reserved"] == 1
        await _fill(tier, small, 16)
        assert tier.stats()["reserve_reclaims"] >= 1
        assert tier.stats()["regions_reserved"] > 1
        held = {k: int(k.rsplit(b"-", 1)[1]) for k in list(tier.keys())}
    finally:
        with caplog.at_level(logging.WARNING, logger=TIER_LOG):
            await tier.close()
    assert tier.stats()["checkpoint_skipped"] == 0
    assert not [r for r in caplog.records if r.name == TIER_LOG and r.levelno >= logging.WARNING]
    again = await _reopen_and_compare(tmp_path, regions, held, size_of)
    await again.close()  # writes the checkpoint again

    path = tmp_path / "tier.log"
    with path.open("rb") as f:
        sb = decode_superblock(f.read(SUPERBLOCK_SIZE))
    assert sb.checkpoint_length
    flip_byte(path, sb.region_offset(sb.checkpoint_regions[0]) + 100)  # its body: a scan next
    scanned = NvmeTier(nvme_config(tmp_path, regions=regions))
    recovered = {r.key for r in await scanned.open()}
    try:
        assert scanned.stats()["recovered_from"] == "scan"
        assert recovered == set(held)
        assert scanned.stats()["checksum_failures"] == 0
    finally:
        await scanned.close()


async def test_a_log_too_small_for_the_reservation_keeps_none(tmp_path: Path) -> None:
    """Two regions: the head and one to reclaim leave none to keep. The whole region area is
    the capacity, a full log skips its checkpoint at close (counted) and the reopen scans."""
    config = nvme_config(tmp_path, regions=2)
    tier = NvmeTier(config)
    assert tier.capacity == 2 * REGION  # before open too
    await tier.open()
    try:
        await _fill(tier, range(600), 4000)
        assert tier.capacity == 2 * REGION
        assert tier.stats()["regions_reserved"] == 0
        assert tier.stats()["regions_free"] == 0
        held = set(tier.keys())
    finally:
        await tier.close()
    assert tier.stats()["checkpoint_skipped"] == 1
    again = NvmeTier(config)
    recovered = {r.key for r in await again.open()}
    try:
        assert again.stats()["recovered_from"] == "scan"
        assert held <= recovered
    finally:
        await again.close()


async def test_capacity_and_room_leave_out_the_reserved_regions(tmp_path: Path) -> None:
    """`capacity` is what the engine budgets against and `room()` what puts may take before a
    reclaim: both leave out the region kept for the checkpoint, from before open on."""
    regions = 4
    tier = NvmeTier(nvme_config(tmp_path, regions=regions, reinsert_hits=0))
    assert tier.capacity == (regions - 1) * REGION
    await tier.open()
    try:
        assert tier.capacity == (regions - 1) * REGION
        usable = REGION - 4096  # a region's header block
        assert tier.room() == (regions - 1) * usable
        await _fill(tier, range(2 * regions * 200), 4000)
        assert tier.stats()["regions_reclaimed"]
        head_rest = tier.room()
        assert head_rest < REGION  # full: only the rest of the head, no region beyond the kept one
        assert tier.stats()["regions_free"] == 1
    finally:
        await tier.close()


# -- the bound against the encoder ---------------------------------------------------------------
KEYS = st.one_of(st.binary(min_size=1, max_size=300),
                 st.integers(250, 70000).map(lambda n: b"k" * min(n, 1 << 16)))
METAS = st.builds(
    lambda kind, dtype, shape, parents, generation: (kind, dtype, shape, parents, generation),
    st.sampled_from(list(ValueKind)), st.text(max_size=20),
    st.lists(st.integers(0, 2**40), max_size=6).map(tuple),
    st.lists(st.binary(min_size=1, max_size=80), max_size=5).map(tuple),
    st.integers(0, 2**64 - 1))


@settings(max_examples=60, deadline=None)
@given(region_count=st.integers(3, 3000), entries=st.lists(
    st.tuples(KEYS, METAS, st.integers(0, 2**16 + 7)), max_size=40),
    shadows=st.lists(st.lists(st.integers(0, 2999), max_size=30), max_size=12),
    offset_unit=st.integers(1, 2**14 - 1), hits=st.integers(0, 2**17))
def test_the_bound_covers_the_encoded_checkpoint(
    region_count: int, entries: list[tuple[bytes, tuple[ValueKind, str, tuple[int, ...],
                                                         tuple[bytes, ...], int], int]],
    shadows: list[list[int]], offset_unit: int, hits: int,
) -> None:
    """Whatever the keys (up to the longest allowed), metadata, numbers within the geometry
    and the regions' shadows, `CheckpointReserve.bound` is at least the encoded checkpoint's
    length, and each entry adds at most `entry_bytes` to it."""
    grain = 64
    region_size = 1 << 30  # offsets and lengths at their widest encoding
    reserve = CheckpointReserve(region_size, region_count)
    index = NvmeIndex(grain, weigh=meta_weight)
    table = RegionTable(region_count)
    sealed = [table[i % region_count] for i in range(len(shadows))]
    for region, links in zip(sealed, shadows, strict=True):
        region.state, region.seq, region.used = RegionState.SEALED, 2**64 - 1, region_size
        region.last_access = 2**63
        region.shadows = {i % region_count for i in links} - {region.index}
    for n, (k, (kind, dtype, shape, parents, generation), slack) in enumerate(entries):
        nbytes = (offset_unit * grain * (n + 1)) % (region_size // 2)
        length = -(-(nbytes + slack + 1) // grain) * grain
        meta = ObjectMeta(kind, dtype, shape, nbytes, generation, parents)
        before, grows = reserve.bound(index), reserve.entry_bytes(len(k), index.weight(meta))
        index.put(k, region=(n * 7919) % region_count, offset=region_size - length,
                  length=length, meta=meta, hits=hits)
        assert reserve.bound(index) - before <= grows
    reserve.tally(table, table.made)
    records = []
    for k in list(index.keys()):
        loc, held = index.get(k), index.meta(k)
        assert loc is not None and held is not None
        records.append(CheckpointEntry(k, loc.region, loc.offset, loc.length, loc.hits,
                                       int(held.kind), held.dtype, held.shape, held.nbytes,
                                       held.generation, held.parents))
    regions = tuple(CheckpointRegion(r.index, r.seq, r.used, r.last_access,
                                     tuple(sorted(r.shadows)))
                    for r in table if r.state is RegionState.SEALED)
    encoded = encode_checkpoint(Checkpoint(bytes(16), 2**64 - 1, regions, records))
    assert len(encoded) <= reserve.bound(index)
