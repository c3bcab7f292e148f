"""`stall_aware_timeout`: a cut-off for slow devices that a stall of the loop itself does not
trigger, and that still cuts off what hangs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tierkv._deadline import MAX_GRACES, stall_aware_timeout


def _answer_from_a_thread(future: asyncio.Future[int], after: float) -> None:
    """Resolve `future` from another thread after `after` seconds, as a device completion does."""
    loop = future.get_loop()

    def answer() -> None:
        time.sleep(after)
        loop.call_soon_threadsafe(future.set_result, 7)

    threading.Thread(target=answer, daemon=True).start()


async def test_an_answer_that_came_during_a_stall_of_the_loop_is_taken() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()
    _answer_from_a_thread(future, 0.01)
    loop.call_soon(time.sleep, 0.2)  # the loop is held up past the 50 ms deadline
    async with stall_aware_timeout(0.05):
        assert await future == 7


async def test_asyncio_timeout_would_have_cut_it_off() -> None:
    """The case above with `asyncio.timeout`: what `stall_aware_timeout` exists for."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()
    _answer_from_a_thread(future, 0.01)
    loop.call_soon(time.sleep, 0.2)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await future


async def test_a_call_still_running_after_a_stall_gets_the_stall_back() -> None:
    # 30 ms of work left when the loop stalls for 200 ms: it finishes in its grace
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, time.sleep, 0.2)
    async with stall_aware_timeout(0.1):
        await asyncio.sleep(0.05)
        await asyncio.sleep(0.03)


async def test_a_hung_call_is_cut_off() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with stall_aware_timeout(0.05):
            await asyncio.sleep(30)
    assert time.monotonic() - started < 10


async def test_a_hung_call_is_cut_off_however_often_the_loop_stalls() -> None:
    loop = asyncio.get_running_loop()
    for i in range(2 * MAX_GRACES):
        loop.call_later(0.03 * (i + 1), time.sleep, 0.06)  # a stall every other timer
    with pytest.raises(TimeoutError):
        async with stall_aware_timeout(0.05):
            await asyncio.sleep(30)


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    async def wait() -> None:
        async with stall_aware_timeout(10):
            await asyncio.sleep(30)

    task = asyncio.create_task(wait())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
