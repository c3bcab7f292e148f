"""Concurrency helpers: bounded fan-out over many items, and waiting out work that must finish
whatever happens to the caller."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, cast

T = TypeVar("T")
R = TypeVar("R")


async def bounded_map(function: Callable[[T], Awaitable[R]], items: Sequence[T],
                      limit: int) -> list[R]:
    """``[await function(item) for item in items]`` with at most `limit` calls in flight.

    A fixed set of `limit` workers takes the next item as each call ends, so 10,000 items make
    `limit` tasks, not 10,000. Results are in the order of `items`. The first exception cancels
    the calls still in flight and is raised; cancelling the caller cancels them too (each call
    must be cancellation-safe on its own).
    """
    count = len(items)
    if count == 0:
        return []
    if count == 1 or limit <= 1:
        return [await function(item) for item in items]
    results: list[R | None] = [None] * count
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            results[index] = await function(items[index])

    workers = [asyncio.ensure_future(worker()) for _ in range(min(limit, count))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    return cast("list[R]", results)  # every slot was filled


async def outlive_cancel(work: Awaitable[T]) -> T:
    """The result of `work` (a transfer using a buffer, a release of resources), waited for to
    its end even when the caller is cancelled meanwhile; the cancellation is raised after it."""
    future = asyncio.ensure_future(work)
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller gets
        raise asyncio.CancelledError
    return future.result()
