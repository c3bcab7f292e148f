"""A mostly free log reclaims its emptiest region, so a large put drops nothing.

The log reclaimed its oldest region (FIFO) whether the log was full or not. A reclaim copies
forward the victim's entries only as far as they leave the put its room, so when the oldest
region was full of live entries and the put was large, most of them were dropped, while the
rest of the log was nearly empty: 10 of 15 cold objects gone for one put of 700 KB into a log
a third full.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiers._nvme_support import key, meta_of, nvme_config, payload_for
from tierkv.config import RegionEviction
from tierkv.tiers.nvme.tier import NvmeTier

COLD, SMALL, LARGE = 15, 64_000, 700_000


async def _put(tier: NvmeTier, i: int, size: int) -> None:
    data = payload_for(i, size)
    await tier.put(key(i), meta_of(data), memoryview(data))


@pytest.mark.parametrize("eviction", list(RegionEviction))
async def test_large_puts_into_a_mostly_free_log_drop_nothing(
        tmp_path: Path, eviction: RegionEviction) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=8, eviction=eviction))
    await tier.open()
    try:
        for i in range(COLD):  # the first region, full of live entries
            await _put(tier, i, SMALL)
        for i in range(100, 100 + 6 * COLD):  # six more regions, nearly all dead
            await _put(tier, i, SMALL)
            assert await tier.delete(key(i))
        for i in range(1000, 1004):  # the log wraps round
            await _put(tier, i, LARGE)
        stats = tier.stats()
        assert stats["regions_reclaimed"] >= 2
        assert stats["entries_dropped"] == 0
        for i in [*range(COLD), *range(1000, 1004)]:
            got = await tier.get(key(i))
            assert got is not None and bytes(got[1]) == payload_for(i, SMALL if i < COLD
                                                                    else LARGE), i
    finally:
        await tier.close()
    again = NvmeTier(nvme_config(tmp_path, regions=8, eviction=eviction))
    await again.open()
    try:  # the deleted keys stay deleted across the reclaims out of order
        for i in range(100, 100 + 6 * COLD):
            assert await again.get(key(i)) is None, i
        for i in range(COLD):
            got = await again.get(key(i))
            assert got is not None and bytes(got[1]) == payload_for(i, SMALL), i
    finally:
        await again.close()


async def test_without_copying_forward_the_configured_order_picks_the_victim(
        tmp_path: Path) -> None:
    """With `reinsert_hits = 0` nothing is copied forward, so every reclaim drops its victim
    whole, mostly free log or not: the least recently read region goes (`eviction = "lru"`),
    not the emptiest one, whose few live entries were read the most recently."""
    config = nvme_config(tmp_path, regions=8, reinsert_hits=0, eviction=RegionEviction.LRU)
    tier = NvmeTier(config)
    await tier.open()
    try:
        for i in range(COLD):  # the first region: never read
            await _put(tier, i, SMALL)
        hot = list(range(100, 100 + 6 * COLD, COLD))
        for i in range(100, 100 + 6 * COLD):  # six regions, one live entry each
            await _put(tier, i, SMALL)
            if i not in hot:
                assert await tier.delete(key(i))
        for i in hot:  # read: their regions are the recently used ones
            assert await tier.get(key(i)) is not None
        for i in range(1000, 1004):
            data = payload_for(i, LARGE)
            dropped = await tier.put(key(i), meta_of(data), memoryview(data))
            if dropped:  # the regions read least recently: the cold one first
                assert {key(i) for i in range(COLD)} <= set(dropped)
                assert key(hot[-1]) not in dropped  # read last
                break
        else:
            pytest.fail("no put reclaimed a region")
    finally:
        await tier.close()
