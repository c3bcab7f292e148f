"""Cut-offs that wait out the event loop's own stalls: `CutOffs(seconds)`, one per component.

Why: a cut-off is meant for a device that is slow, not for a loop that was. When the loop is
held up for longer than a timeout — a long synchronous call in the application, a garbage
collection, the process descheduled on a busy machine — `asyncio.timeout` fires the moment the
loop runs again, and cancels every call in flight although their devices answered meanwhile:
asyncio runs the timers that fell due in the same turn as the IO completions the loop takes in,
before the tasks those completions resume. A 150 ms stall during a `get_many` of the pool and
the log cut off every read then in flight (32 at queue depth 32), each a miss and a failure
counted against the tier's circuit breaker: enough to open it, so that reads skipped a healthy
tier for its whole cool-down (seen as "lost" objects in a fault soak on a loaded CI machine).

What it does instead: when a call's deadline is seen later than `STALL_SHARE` of the timeout,
the loop was held up, and the call is given that lateness again (at most `MAX_GRACES` times, so
that a loop late at every turn still cuts off a hung device); and when it does expire, it is
cancelled one loop turn later, so that a completion the loop took in with the deadline resumes
its caller first.

Why one timer for many calls: every read and write of a device tier is bounded, and a timer
per call (`asyncio.timeout`: a timer handle made, pushed on the loop's heap and cancelled) cost
about 7 µs of the loop per call on a slow vCPU, as much as the rest of a small put's bookkeeping.
The calls of one component share one length, so one timer armed at the earliest deadline and
looked at once per timeout serves them all; a call only enters and leaves a dict.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

#: lateness past a deadline, as a share of the timeout, that says the loop itself was held up
STALL_SHARE = 0.25
#: how many times one call is given a stall's time again
MAX_GRACES = 3

_RUNNING, _EXPIRING, _CUT, _DONE = range(4)


class CutOffs:
    """Stall-aware cut-offs of `seconds` for the calls of one component (a tier's guard)::

        with cut_offs():   # TimeoutError when the block is cut off
            await call()

    Used on one event loop at a time (a component made on one loop and used on another starts
    afresh there)."""

    __slots__ = ("_calls", "_due", "_handle", "_loop", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._calls: dict[CutOff, None] = {}  # the blocks running now
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0  # when `_handle` fires

    def __call__(self) -> CutOff:
        return CutOff(self)

    def _task(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Task[object]]:
        loop = self._loop
        # asking with the loop saves `get_running_loop` (a getpid system call in 3.11) per call
        if loop is not None and (task := asyncio.current_task(loop)) is not None:
            return loop, task
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a cut-off is used inside a task")
        # a task here and none on the loop kept: a new loop (what ran on the old one is gone)
        self._loop, self._handle = loop, None
        self._calls.clear()
        return loop, task

    def _started(self, call: CutOff, due: float) -> None:
        self._calls[call] = None
        if self._handle is None or due < self._due:
            self._arm(due)

    def _arm(self, due: float) -> None:
        assert self._loop is not None
        if self._handle is not None:
            self._handle.cancel()
        self._due = due
        self._handle = self._loop.call_at(due, self._sweep)

    def _sweep(self) -> None:
        """The timer: expire the calls past their deadline, give those the loop kept waiting
        their lateness again, and arm for the next deadline."""
        loop = self._loop
        assert loop is not None
        self._handle = None
        now = loop.time()
        stall = STALL_SHARE * self.seconds
        earliest: float | None = None
        for call in list(self._calls):
            if call.due <= now:
                late = now - call.due
                if late > stall and call.graces < MAX_GRACES:
                    call.graces += 1
                    call.due = now + late
                else:
                    del self._calls[call]
                    call.state = _EXPIRING
                    loop.call_at(now, self._cut, call)  # at the next turn (module docstring)
                    continue
            if earliest is None or call.due < earliest:
                earliest = call.due
        if earliest is not None:
            self._arm(earliest)

    @staticmethod
    def _cut(call: CutOff) -> None:
        if call.state == _EXPIRING:  # still running: its answer did not come in with the timer
            call.state = _CUT
            call.task.cancel()


class CutOff:
    """One block under a `CutOffs` (a context manager, entered once)."""

    __slots__ = ("_cancelling", "_owner", "due", "graces", "state", "task")

    def __init__(self, owner: CutOffs) -> None:
        self._owner = owner
        self.graces = 0
        self.state = _RUNNING

    def __enter__(self) -> None:
        owner = self._owner
        loop, self.task = owner._task()
        self._cancelling = self.task.cancelling()
        self.due = loop.time() + owner.seconds
        owner._started(self, self.due)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._owner._calls.pop(self, None)
        state, self.state = self.state, _DONE
        if state == _CUT and self.task.uncancel() <= self._cancelling and (
                kind is asyncio.CancelledError):
            raise TimeoutError from exc


def stall_aware_timeout(seconds: float) -> CutOff:
    """One block cut off after `seconds` (`TimeoutError`), what the loop's own stalls took from
    it given back (the module docstring); `CutOffs` for the many calls of one component."""
    return CutOffs(seconds)()
