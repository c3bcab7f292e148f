"""A timeout that waits out the event loop's own stalls: `stall_aware_timeout(seconds)`.

Why: a cut-off is meant for a device that is slow, not for a loop that was. When the loop is
held up for longer than a timeout — a long synchronous call in the application, a garbage
collection, the process descheduled on a busy machine — `asyncio.timeout` fires the moment the
loop runs again, and cancels every call in flight although their devices answered meanwhile:
asyncio runs the timers that fell due in the same turn as the IO completions the loop takes in,
before the tasks those completions resume. A 150 ms stall during a `get_many` of the pool and
the log cut off every read then in flight (32 at queue depth 32), each a miss and a failure
counted against the tier's circuit breaker: enough to open it, so that reads skipped a healthy
tier for its whole cool-down (seen as "lost" objects in a fault soak on a loaded CI machine).

What it does instead: when its timer runs later than `STALL_SHARE` of the timeout, the loop was
held up, and the call is given that lateness again (at most `MAX_GRACES` times, so that a loop
late at every turn still cuts off a hung device); and when it does expire, it cancels the call
one loop turn later, so that a completion the loop took in with the timer resumes its caller
first.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

#: lateness of the timer, as a share of the timeout, that says the loop itself was held up
STALL_SHARE = 0.25
#: how many times one call is given a stall's time again
MAX_GRACES = 3


class _StallAwareTimeout:
    __slots__ = ("_graces", "_handle", "_loop", "_seconds", "_timeout")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._graces = 0
        self._handle: asyncio.TimerHandle | None = None
        self._timeout = asyncio.timeout(None)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()
        self._loop = asyncio.get_running_loop()
        due = self._loop.time() + self._seconds
        self._handle = self._loop.call_at(due, self._expire, due)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
        await self._timeout.__aexit__(kind, exc, traceback)

    def _expire(self, due: float) -> None:
        now = self._loop.time()
        late = now - due
        if late > STALL_SHARE * self._seconds and self._graces < MAX_GRACES:
            self._graces += 1
            self._handle = self._loop.call_at(now + late, self._expire, now + late)
            return
        self._handle = None
        self._timeout.reschedule(now)  # expires at the next turn (`asyncio.Timeout`)


def stall_aware_timeout(seconds: float) -> _StallAwareTimeout:
    """Like ``asyncio.timeout(seconds)`` (`TimeoutError` when it cuts the block off), but
    what the loop's own stalls took from the block is given back (the module docstring)."""
    return _StallAwareTimeout(seconds)
