"""Region reclaim of the NVMe tier: FIFO and LRU victims, reinsertion of hot entries, bounded
space, and a constant file count however many objects are stored."""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import pytest

from tests.tiers._nvme_support import REGION, key, meta_of, nvme_config, payload_for, per_region
from tierkv.config import RegionEviction
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier


async def _put_all(tier: NvmeTier, ids: range, size: int = 8000) -> set[bytes]:
    dropped: set[bytes] = set()
    for i in ids:
        data = payload_for(i, size)
        dropped.update(await tier.put(key(i), meta_of(data), memoryview(data)))
    return dropped


async def test_fifo_drops_oldest_region_and_reports_it(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=3, reinsert_hits=0))
    await tier.open()
    try:
        dropped = await _put_all(tier, range(600))
        assert dropped
        assert key(0) in dropped and key(599) not in dropped
        held = set(tier.keys())
        assert not held & dropped
        assert held | dropped == {key(i) for i in range(600)}
        assert tier.used <= tier.capacity
        assert tier.stats()["regions_reclaimed"] >= 1
    finally:
        await tier.close()


async def test_hot_entries_are_reinserted(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=3, reinsert_hits=2))
    await tier.open()
    try:
        await _put_all(tier, range(100))
        for _ in range(2):
            assert await tier.get(key(3)) is not None
        dropped = await _put_all(tier, range(100, 400))
        assert key(3) not in dropped and key(4) in dropped
        got = await tier.get(key(3))
        assert got is not None and payload_bytes(got[1]) == payload_for(3, 8000)
        assert tier.stats()["entries_reinserted"] >= 1
    finally:
        await tier.close()


async def test_the_owners_reclaim_worth_decides_what_is_copied_forward(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=3, reinsert_hits=2))
    kept = {key(i) for i in range(0, 40, 2)}
    asked: set[bytes] = set()

    def worth(name: bytes) -> float:
        asked.add(name)
        return 1.0 if name in kept else 0.0

    tier.set_reclaim_worth(worth)
    await tier.open()
    try:
        dropped = await _put_all(tier, range(40))
        for _ in range(2):  # read often enough for `reinsert_hits`: the worth overrules it
            assert await tier.get(key(1)) is not None
        dropped |= await _put_all(tier, range(40, 400))
        assert key(1) in dropped and key(0) in asked and key(1) in asked
        assert not kept & dropped
        for name in kept:
            got = await tier.get(name)
            i = int(name.rsplit(b"-", 1)[1])
            assert got is not None and payload_bytes(got[1]) == payload_for(i, 8000)
        assert tier.stats()["entries_reinserted"] >= len(kept)
    finally:
        await tier.close()


async def test_valuing_everything_still_makes_room_for_each_put_most_valuable_kept(
        tmp_path: Path) -> None:
    """A reclaim copies forward only what leaves room for the entry it was for, the most
    valuable entries first: an owner valuing every entry slows the log down but never makes it
    rewrite regions without end, and what it values most stays."""
    tier = NvmeTier(nvme_config(tmp_path, regions=3, reinsert_hits=2))
    tier.set_reclaim_worth(lambda name: math.inf if name.endswith(b"0") else 1.0)
    await tier.open()
    try:
        count = 3 * per_region(8000)
        dropped = await asyncio.wait_for(_put_all(tier, range(count)), 30)
        assert dropped and key(count - 1) not in dropped
        assert set(tier.keys()) | dropped == {key(i) for i in range(count)}
        assert not {key(i) for i in range(0, count, 10)} & dropped
        assert tier.used <= tier.capacity
    finally:
        await tier.close()


async def test_reinsert_hits_0_copies_nothing_forward_whatever_the_worth(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=3, reinsert_hits=0))
    tier.set_reclaim_worth(lambda name: 1.0)
    await tier.open()
    try:
        assert key(0) in await _put_all(tier, range(400))
        assert tier.stats()["entries_reinserted"] == 0
    finally:
        await tier.close()


async def test_reinsert_hits_0_still_copies_what_the_owner_must_not_lose(tmp_path: Path) -> None:
    """Copying forward off (endurance first) drops what the owner values, but not what it
    values infinitely (its only durable copy of something it cannot lose: the engine's records
    of refused deletes); None is the tier's own rule, which at 0 keeps nothing."""
    tier = NvmeTier(nvme_config(tmp_path, regions=3, reinsert_hits=0))
    tier.set_reclaim_worth(lambda name: math.inf if name == key(0) else None)
    await tier.open()
    try:
        dropped = await _put_all(tier, range(400))
        assert key(0) not in dropped and key(1) in dropped
        got = await tier.get(key(0))
        assert got is not None and payload_bytes(got[1]) == payload_for(0, 8000)
        assert tier.stats()["entries_reinserted"] >= 1
    finally:
        await tier.close()


async def test_lru_keeps_recently_read_region(tmp_path: Path) -> None:
    # four regions, one kept free for the checkpoint: three for data
    tier = NvmeTier(nvme_config(tmp_path, regions=4, reinsert_hits=0,
                                eviction=RegionEviction.LRU))
    await tier.open()
    try:
        per = per_region(9000)  # 114 packed entries a region
        first = 2 * per + per // 2
        await _put_all(tier, range(first), size=9000)  # regions 0, 1 full, region 2 the head
        assert await tier.get(key(0)) is not None  # the oldest region is now the most recent
        dropped = await _put_all(tier, range(first, first + per), size=9000)
        assert key(0) not in dropped
        assert key(per + 10) in dropped  # region 1, the least recently used
    finally:
        await tier.close()


async def test_file_count_is_constant(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=2))
    await tier.open()
    try:
        size = (tmp_path / "tier.log").stat().st_size
        for start in range(0, 3000, 500):
            await _put_all(tier, range(start, start + 500), size=2000)
            await tier.flush()
            assert os.listdir(tmp_path) == ["tier.log"]
            assert (tmp_path / "tier.log").stat().st_size == size
    finally:
        await tier.close()
    assert os.listdir(tmp_path) == ["tier.log"]


async def test_region_bookkeeping_grows_with_use_not_capacity(tmp_path: Path) -> None:
    """A 16 GiB log (allocated whole by `posix_fallocate`, so the disk must have the room)
    written lightly keeps DRAM state for the regions it touched only, across a close and a
    scan-free reopen; the untouched ones still count as free."""
    import shutil
    import tracemalloc

    regions = 16384
    free = shutil.disk_usage(tmp_path).free
    if free < (regions + 1024) * REGION:
        pytest.skip(f"a log of {regions} MiB regions needs that much free disk under "
                    f"{tmp_path}, which has {free >> 20} MiB")
    config = nvme_config(tmp_path, regions=regions, reinsert_hits=0)
    tracemalloc.start()
    try:
        tier = NvmeTier(config)
        await tier.open()
        try:
            await _put_all(tier, range(300))  # ~2.3 MiB: three regions
            stats = tier.stats()
            assert stats["regions_in_memory"] <= 8
            assert stats["regions_free"] + stats["regions_used"] == regions
            assert stats["regions_free"] >= regions - 8
            _current, peak = tracemalloc.get_traced_memory()
        finally:
            await tier.close()
    finally:
        tracemalloc.stop()
    # one eager Region with its sets is ~600 bytes: 16384 of them would be ~10 MB (measured
    # peak with lazy regions: 0.4 MB)
    assert peak < 4 << 20
    reopened = NvmeTier(config)
    await reopened.open()
    try:
        assert reopened.stats()["regions_in_memory"] <= 16
        got = await reopened.get(key(299))
        assert got is not None and payload_bytes(got[1]) == payload_for(299, 8000)
    finally:
        await reopened.close()
