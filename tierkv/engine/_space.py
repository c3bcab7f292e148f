"""One tier's free space as the engine manages it: watermarks, waiting writers, the evictor's cue.

A tier the engine evicts from (not `reclaims_space`) keeps free space between its watermarks:
whenever a copy is stored and less than `low` is free, the tier's evictor is cued and moves the
scheduler's victims out in the background until `high` is free. A write that does not fit waits
here (backpressure) until a departure frees space — it is woken by the departure, never by
polling — for at most the engine's `space_timeout`, then fails with `TierFullError`. When the
evictor finds nothing it may move (everything pinned or busy) and nothing is leaving, it
*starves* the waiters: they stop waiting and their writes go to the next tier.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tierkv.errors import EngineClosedError, TierFullError
from tierkv.scheduler import Watermarks
from tierkv.tiers.base import Tier


@dataclass(slots=True, eq=False)
class _Waiter:
    nbytes: int
    footprint: int
    #: True: space was freed, try again; False: starved; None: the deadline passed
    woken: asyncio.Future[bool | None]


def _expire(woken: asyncio.Future[bool | None]) -> None:
    if not woken.done():
        woken.set_result(None)


class TierSpace:
    def __init__(self, tier: Tier, fractions: tuple[float, float] | None, timeout: float) -> None:
        self.tier = tier
        #: (free_low, free_high) of capacity; ``None`` for a tier that reclaims space itself
        self._fractions = fractions
        self.timeout = timeout
        #: footprint bytes of departures under way (planned or running)
        self.leaving = 0
        #: set to wake the evictor (a store left the tier short, a write waits, a departure ended)
        self.cue = asyncio.Event()
        self._waiters: list[_Waiter] = []
        #: writers woken to try again that have not run yet: the room freed is theirs
        self._woken = 0
        self._closed = False
        self._marks: tuple[int, Watermarks | None] = (-1, None)  # (capacity, its watermarks)

    @property
    def watermarks(self) -> Watermarks | None:
        """In bytes, of the capacity the tier has now (a pmem pool may hold less than asked)."""
        if self._fractions is None:
            return None
        capacity, marks = self._marks
        if capacity != self.tier.capacity or marks is None:
            capacity = self.tier.capacity
            marks = Watermarks.of(capacity, *self._fractions)
            self._marks = (capacity, marks)
        return marks

    @property
    def free(self) -> int:
        return self.tier.capacity - self.tier.used

    @property
    def waiting(self) -> bool:
        return bool(self._waiters)

    @property
    def promised(self) -> bool:
        """Whether writers were woken to take room and have not run yet."""
        return self._woken > 0

    @property
    def wanted(self) -> bool:
        """Whether writers wait for room, or were just woken to take it: background moves
        (promotions) must leave the room alone then."""
        return bool(self._waiters) or self._woken > 0

    def to_free(self) -> int:
        """Bytes the evictor should still set moving (see `Watermarks.to_free`)."""
        watermarks = self.watermarks
        if watermarks is None:
            return 0
        wanted = max((w.footprint for w in self._waiters), default=0)
        return watermarks.to_free(self.free, self.leaving, wanted)

    def stored(self) -> None:
        """A copy entered the tier: cue the evictor if the tier is now short of space."""
        watermarks = self.watermarks
        if watermarks is not None and watermarks.short(self.free):
            self.cue.set()

    def freed(self) -> None:
        """A copy left the tier: the writers waiting longest try again, in the order they came,
        as many as the free space can hold (at least one). Waking them all made every departure
        cost a futile retry per writer waiting."""
        room = self.free
        woke = False
        while self._waiters:
            waiter = self._waiters[0]
            if not waiter.woken.done():
                if woke and waiter.footprint > room:
                    break
                waiter.woken.set_result(True)
                self._woken += 1
                woke = True
                room -= waiter.footprint
            self._waiters.pop(0)

    def wake_fitting(self) -> bool:
        """Wake every waiting writer whose object fits now, in the order they came (a write
        that took the room a departure made for one writer can leave another waiting while
        enough is free for it); whether any was woken."""
        woke = False
        for waiter in self._waiters:
            if not waiter.woken.done() and self.tier.fits(waiter.nbytes):
                waiter.woken.set_result(True)
                self._woken += 1
                woke = True
        self._waiters = [w for w in self._waiters if not w.woken.done()]
        return woke

    def starve(self) -> None:
        """The evictor can move nothing out: waiting writers whose object fits try again, the
        others give up on this tier."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.woken.done():
                fits = self.tier.fits(waiter.nbytes)
                waiter.woken.set_result(fits)
                self._woken += fits

    def close(self) -> None:
        """The engine is closing: waiting writers fail with `EngineClosedError`."""
        self._closed = True
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.woken.done():
                waiter.woken.set_exception(EngineClosedError("the engine is closing"))

    async def wait_for_room(self, nbytes: int, deadline: float) -> bool:
        """Wait until a departure frees space (True: try the write again) or the evictor has
        nothing to move (False). `TierFullError` at `deadline` (loop time)."""
        if self._closed:
            raise EngineClosedError("the engine is closing")
        if self._fractions is None:
            return False
        loop = asyncio.get_running_loop()
        if deadline <= loop.time():
            raise self._full(nbytes)
        waiter = _Waiter(nbytes, self.tier.footprint(nbytes), loop.create_future())
        self._waiters.append(waiter)
        self.cue.set()
        # a timer that resolves the future, not `wait_for` (on 3.11 it returns the result of a
        # future that completed as the caller was cancelled, swallowing the cancellation) nor
        # `asyncio.timeout` (its bookkeeping cost more than the wait, per retry)
        timer = loop.call_at(deadline, _expire, waiter.woken)
        try:
            woken = await waiter.woken
            if woken:
                self._woken -= 1
        except asyncio.CancelledError:
            if waiter.woken.done() and not waiter.woken.cancelled() and waiter.woken.result():
                self._woken -= 1
                self.freed()  # woken as it was cancelled: pass the room on to the next writer
            raise
        finally:
            timer.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        if woken is None:
            raise self._full(nbytes)
        return woken

    def _full(self, nbytes: int) -> TierFullError:
        return TierFullError(f"tier {self.tier.name!r}: no room for {nbytes} bytes within "
                             f"{self.timeout:g}s (writes outran the moves out of it)")
