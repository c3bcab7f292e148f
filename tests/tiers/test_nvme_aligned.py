"""The NVMe tier's aligned buffer pool: prefaulted, huge-page-advised buffers, reuse."""

from __future__ import annotations

import os
from pathlib import Path

from tests.tiers._nvme_support import nvme_config
from tierkv.tiers.nvme._state import SEALS_IN_FLIGHT
from tierkv.tiers.nvme.io._aligned import HUGE_MIN, PAGE, AlignedBuffer, AlignedPool
from tierkv.tiers.nvme.tier import NvmeTier


def test_prefaulted_buffer_is_zeroed_aligned_and_writable() -> None:
    buf = AlignedBuffer(2 * HUGE_MIN, prefault=True)
    try:
        assert buf.address % PAGE == 0
        assert not any(buf.view[:: PAGE])
        data = os.urandom(1 << 20)
        buf.view[HUGE_MIN : HUGE_MIN + len(data)] = data
        assert bytes(buf.view[HUGE_MIN : HUGE_MIN + len(data)]) == data
    finally:
        buf.close()


def test_pool_reuses_a_released_region_buffer() -> None:
    pool = AlignedPool()
    try:
        first = pool.acquire(HUGE_MIN, prefault=True)
        pool.release(first)
        again = pool.acquire(HUGE_MIN, prefault=True)
        assert again is first
        assert pool.misses == 1
        pool.release(again)
    finally:
        pool.close()


def test_warm_pool_serves_without_mapping() -> None:
    pool = AlignedPool()
    try:
        pool.warm(HUGE_MIN, 3)
        assert pool.misses == 3 and pool.mapped == 3 * HUGE_MIN
        held = [pool.acquire(HUGE_MIN) for _ in range(3)]
        assert pool.misses == 3  # all three came from the warmed free list
        for buf in held:
            pool.release(buf)
        pool.warm(HUGE_MIN, 3)  # already there: nothing new is mapped
        assert pool.misses == 3
    finally:
        pool.close()


async def test_open_tier_has_its_region_buffers_mapped(tmp_path: Path) -> None:
    """The head and the regions being sealed never fault their buffers in during a put."""
    config = nvme_config(tmp_path)
    tier = NvmeTier(config)
    await tier.open()
    try:
        assert tier.stats()["buffer_bytes_mapped"] >= (1 + SEALS_IN_FLIGHT) * config.region_size
    finally:
        await tier.close()
