"""Drive a coroutine by hand, one suspension at a time, to cancel it at a chosen await.

A test that starts an operation as a task, sleeps a little and cancels it does not know where
the task stands at the cancel: that depends on the loop's schedule, on worker threads, and on
every await the operation gained since the test was written. `Stepped` runs the coroutine in the
calling task instead: `step()` runs it up to its next suspension (first waiting, as a task would,
for what it is suspended on), and `cancel()` cancels it right there, as `Task.cancel` does: the
future it awaits is cancelled and it is resumed to see that. Nothing else runs between a step
and the cancel unless the test awaits, so "cancelled at its k-th await" is the same point on every
run, and a test can go through every await of an operation in turn (`cancel_at`).

The coroutine runs in the caller's task: `asyncio.current_task()` is the caller's there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Stepped(Generic[T]):
    """One coroutine, driven by hand (see the module docstring)."""

    def __init__(self, coroutine: Coroutine[Any, Any, T]) -> None:
        self._coroutine = coroutine
        self._awaiting: asyncio.Future[Any] | None = None
        self._started = False
        self._done = False
        self._result: T | None = None

    @property
    def done(self) -> bool:
        return self._done

    def result(self) -> T:
        """What the coroutine returned (once `step` said it has)."""
        if not self._done:
            raise RuntimeError("the coroutine has not returned")
        return self._result  # type: ignore[return-value]

    async def step(self) -> bool:
        """Run it to its next suspension: True while it is suspended there, False once it has
        returned. The first step starts it; later ones first wait for what it awaits. What it
        raises propagates."""
        if self._done:
            raise RuntimeError("the coroutine has ended")
        if self._started:
            await self._settle()
        self._started = True
        return self._resume(None)

    async def cancel(self) -> None:
        """Cancel it at the await where it is suspended and run it to its end (its clean-up
        may await). Raises the `CancelledError` it ends with, or whatever it raised instead;
        `AssertionError` when it returned as if it had not been cancelled."""
        if self._done or not self._started:
            raise RuntimeError("only a suspended coroutine can be cancelled")
        awaiting = self._awaiting
        if awaiting is not None and awaiting.cancel():
            suspended = self._resume(None)  # it finds the future it awaits cancelled
        else:  # a bare yield, or a future already done: the cancel goes in where it resumes
            suspended = self._resume(asyncio.CancelledError())
        while suspended:
            await self._settle()
            suspended = self._resume(None)
        raise AssertionError("the coroutine returned although it was cancelled")

    async def _settle(self) -> None:
        if self._awaiting is None:  # a bare yield (`asyncio.sleep(0)`): one turn of the loop
            await asyncio.sleep(0)
        else:
            await asyncio.wait({self._awaiting})

    def _resume(self, error: BaseException | None) -> bool:
        try:
            awaiting = (self._coroutine.send(None) if error is None
                        else self._coroutine.throw(error))
        except StopIteration as stop:
            self._done = True
            self._result = stop.value
            self._awaiting = None
            return False
        except BaseException:
            self._done = True
            self._awaiting = None
            raise
        if awaiting is not None:
            if not asyncio.isfuture(awaiting):
                raise TypeError(f"the coroutine yielded {awaiting!r}, not an asyncio future")
            # the flag a future's __await__ sets on yielding it; its task clears it on taking it
            awaiting._asyncio_future_blocking = False
        self._awaiting = awaiting
        return True


async def cancel_at(operation: Callable[[int], Coroutine[Any, Any, T]], *,
                    meanwhile: Callable[[int], Awaitable[None]] | None = None,
                    after: Callable[[int], Awaitable[None]] | None = None) -> tuple[int, T]:
    """Cancel ``operation(k)`` at its k-th await, for k = 1, 2, ... until a run returns before
    its k-th await; every cancelled run must end in `CancelledError`. ``meanwhile(k)`` is
    awaited while run k is suspended at that await, just before the cancel; ``after(k)`` once
    it has ended. Returns how many runs were cancelled and what the last run returned."""
    k = 0
    while True:
        k += 1
        run = Stepped(operation(k))
        for _ in range(k):
            if not await run.step():
                return k - 1, run.result()
        if meanwhile is not None:
            await meanwhile(k)
        with contextlib.suppress(asyncio.CancelledError):
            await run.cancel()
        if after is not None:
            await after(k)
