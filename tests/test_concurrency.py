"""`bounded_map`: order, a fixed number in flight, errors and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from tierkv._concurrency import bounded_map


async def test_results_in_order_with_at_most_limit_in_flight() -> None:
    in_flight = peak = 0
    tasks_before = len(asyncio.all_tasks())
    peak_tasks = 0

    async def work(item: int) -> int:
        nonlocal in_flight, peak, peak_tasks
        in_flight += 1
        peak = max(peak, in_flight)
        peak_tasks = max(peak_tasks, len(asyncio.all_tasks()) - tasks_before)
        await asyncio.sleep(0.001 * (item % 3))
        in_flight -= 1
        return item * 2

    assert await bounded_map(work, list(range(10_000)), 16) == [i * 2 for i in range(10_000)]
    assert peak == 16
    assert peak_tasks <= 16  # workers, not one task per item


async def test_small_inputs() -> None:
    async def double(item: int) -> int:
        return item * 2

    assert await bounded_map(double, [], 4) == []
    assert await bounded_map(double, [3], 4) == [6]
    assert await bounded_map(double, [1, 2], 1) == [2, 4]


async def test_first_error_cancels_the_rest() -> None:
    cancelled = 0

    async def work(item: int) -> int:
        nonlocal cancelled
        if item == 3:
            raise ValueError("boom")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled += 1
            raise
        return item

    with pytest.raises(ValueError, match="boom"):
        await bounded_map(work, list(range(8)), 4)
    assert cancelled == 3  # the three others in flight when item 3 failed


async def test_cancelling_the_caller_cancels_the_calls_in_flight() -> None:
    started = asyncio.Event()
    cancelled = 0

    async def work(item: int) -> int:
        nonlocal cancelled
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled += 1
            raise
        return item

    task = asyncio.ensure_future(bounded_map(work, list(range(100)), 5))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == 5
