"""The NVMe tier's aligned buffer pool: prefaulted, huge-page-advised buffers, reuse."""

from __future__ import annotations

import os

from tierkv.tiers._aligned import HUGE_MIN, PAGE, AlignedBuffer, AlignedPool


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
