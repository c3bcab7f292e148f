"""`NvmeTier.on_media`: a copy is on media for sure only once a sync covered its write.

The engine records the edges of keys held nowhere on media ahead of a copy derived from them
(`engine._departed`); a log copy counted as on media while it sat in the head's buffer, or in a
region written since the last sync, so a `kill -9` lost it with its edges while the derived
copy came back, linked to nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.tiers._nvme_support import REGION, key, meta_of, nvme_config, payload_for
from tierkv.tiers.nvme.tier import NvmeTier


async def _put(tier: NvmeTier, i: int, size: int = 8000) -> None:
    data = payload_for(i, size)
    await tier.put(key(i), meta_of(data), memoryview(data))


async def test_a_copy_in_the_head_is_on_media_once_a_flush_synced_it(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=4))
    await tier.open()
    try:
        await _put(tier, 0)
        assert not tier.on_media(key(0))  # in the head's buffer
        await tier.flush()
        assert tier.on_media(key(0))
        await _put(tier, 1)  # the same head, after the flush
        assert tier.on_media(key(0)) and not tier.on_media(key(1))
        await tier.flush()
        assert tier.on_media(key(1))
    finally:
        await tier.close()


async def test_a_sealed_region_is_on_media_once_a_later_sync_ended(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=4))
    await tier.open()
    try:
        count = REGION // 8000 + 10  # a region's worth and more: the first is sealed
        for i in range(count):
            await _put(tier, i)
        for _ in range(500):  # its write ends in the background
            if tier.stats()["bytes_written"] >= REGION // 2:
                break
            await asyncio.sleep(0.01)
        assert tier.stats()["bytes_written"] >= REGION // 2
        assert not tier.on_media(key(0))  # written, not synced
        await tier.flush()
        assert all(tier.on_media(key(i)) for i in range(count))
    finally:
        await tier.close()
