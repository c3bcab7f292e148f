"""`stall_aware_timeout`: a cut-off for slow devices that a stall of the loop itself does not
trigger, and that still cuts off what hangs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tierkv._deadline import MAX_GRACES, CutOffs, stall_aware_timeout


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
    with stall_aware_timeout(0.05):
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
    with stall_aware_timeout(0.1):
        await asyncio.sleep(0.05)
        await asyncio.sleep(0.03)


async def test_a_hung_call_is_cut_off() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError), stall_aware_timeout(0.05):
        await asyncio.sleep(30)
    assert time.monotonic() - started < 10


async def test_a_hung_call_is_cut_off_however_often_the_loop_stalls() -> None:
    loop = asyncio.get_running_loop()
    for i in range(2 * MAX_GRACES):
        loop.call_later(0.03 * (i + 1), time.sleep, 0.06)  # a stall every other timer
    with pytest.raises(TimeoutError), stall_aware_timeout(0.05):
        await asyncio.sleep(30)


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    async def wait() -> None:
        with stall_aware_timeout(10):
            await asyncio.sleep(30)

    task = asyncio.create_task(wait())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_hung_call_among_many_of_one_component_is_cut_off_alone() -> None:
    cut_offs = CutOffs(0.05)
    finished = 0

    async def quick() -> None:
        nonlocal finished
        for _ in range(20):
            with cut_offs():
                await asyncio.sleep(0.005)
            finished += 1

    async def hung() -> None:
        with cut_offs():
            await asyncio.sleep(30)

    started = time.monotonic()
    results = await asyncio.gather(hung(), *(quick() for _ in range(8)), return_exceptions=True)
    assert isinstance(results[0], TimeoutError)
    assert results[1:] == [None] * 8
    assert finished == 8 * 20
    assert time.monotonic() - started < 10


def test_a_component_used_on_a_new_loop_cuts_off_there() -> None:
    cut_offs = CutOffs(0.05)

    async def quick() -> None:
        with cut_offs():
            await asyncio.sleep(0)

    async def hung() -> None:
        with cut_offs():
            await asyncio.sleep(30)

    asyncio.run(quick())
    with pytest.raises(TimeoutError):
        asyncio.run(hung())


async def test_a_cut_off_outside_a_task_is_refused() -> None:
    cut_offs = CutOffs(1)
    failed: list[BaseException] = []

    def in_a_callback() -> None:
        try:
            with cut_offs():
                pass
        except RuntimeError as exc:
            failed.append(exc)

    asyncio.get_running_loop().call_soon(in_a_callback)
    await asyncio.sleep(0.01)
    assert len(failed) == 1
