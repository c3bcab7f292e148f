"""The byte budget of background moves: a shared rate, in bytes per second, for all of them."""

from __future__ import annotations

import asyncio
import contextlib


class ByteBudget:
    """Moves take their bytes from one virtual clock running at `rate` bytes per second.

    Each `take` books the next `nbytes / rate` seconds of it and sleeps until its booking
    starts, so moves together never copy faster than the rate (averaged over one move) and the
    sleeping is the pacing itself, not a poll. ``rate=None``: unlimited. `lift` ends the pacing
    for good, waking every sleeper (close: a backlog paced at a low rate would hold it for
    backlog / rate seconds).
    """

    def __init__(self, rate: int | None) -> None:
        self.rate = rate
        self._clock = 0.0
        #: set by `lift`; made on first use, on the loop that paces
        self._lifted: asyncio.Event | None = None

    async def take(self, nbytes: int) -> None:
        """Wait for `nbytes` of budget (callers skip the call when `rate` is ``None``)."""
        if self.rate is None:
            return
        now = asyncio.get_running_loop().time()
        start = max(now, self._clock)
        self._clock = start + nbytes / self.rate
        if start > now:
            if self._lifted is None:
                self._lifted = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(start - now):
                    await self._lifted.wait()

    def lift(self) -> None:
        """Unlimited from now on; moves sleeping for their booking go at once."""
        self.rate = None
        if self._lifted is not None:
            self._lifted.set()
