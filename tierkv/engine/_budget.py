"""The byte budget of background moves: a shared rate, in bytes per second, for all of them."""

from __future__ import annotations

import asyncio


class ByteBudget:
    """Moves take their bytes from one virtual clock running at `rate` bytes per second.

    Each `take` books the next `nbytes / rate` seconds of it and sleeps until its booking
    starts, so moves together never copy faster than the rate (averaged over one move) and the
    sleeping is the pacing itself, not a poll. ``rate=None``: unlimited.
    """

    def __init__(self, rate: int | None) -> None:
        self.rate = rate
        self._clock = 0.0

    async def take(self, nbytes: int) -> None:
        """Wait for `nbytes` of budget (callers skip the call when `rate` is ``None``)."""
        if self.rate is None:
            return
        now = asyncio.get_running_loop().time()
        start = max(now, self._clock)
        self._clock = start + nbytes / self.rate
        if start > now:
            await asyncio.sleep(start - now)
