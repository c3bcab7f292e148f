"""The background evictor of one tier: keeps free space between the tier's watermarks.

It sleeps until its tier's space is cued (`TierSpace.cue`: a store left the tier short, a writer
waits for room, a departure ended), then asks the scheduler for victims and hands their plans to
the executor until what is free plus what is leaving reaches the high watermark (or what the
waiting writers want). It never waits for a move itself, so a slow move never holds up the
others. Nothing in the foreground runs a demotion: puts only wait, and are woken by the
departures this starts.
"""

from __future__ import annotations

import asyncio

from tierkv.engine._executor import MoveExecutor
from tierkv.engine._state import EngineState
from tierkv.scheduler import Departure

#: failed moves in a row before the evictor pauses (a device that tears a write now and then
#: must not slow the evictor down), then the seconds of its first pause, doubling with each
#: failure in a row up to the maximum
FAILURES_BEFORE_PAUSE = 3
FAILED_MOVE_PAUSE = 0.01
MAX_FAILED_MOVE_PAUSE = 1.0


class Evictor:
    def __init__(self, state: EngineState, tier: int, executor: MoveExecutor) -> None:
        self._st = state
        self._tier = tier
        self._executor = executor
        #: moves out of this tier that failed in a row, and the loop time before which it
        #: plans no more
        self._failures = 0
        self._resume_at = 0.0
        #: pins hold objects in the first tier
        self._pinnable = tier == 0

    def protected(self, key: bytes) -> bool:
        """Whether `key` may not be moved out now: busy, already moving, or pinned (here in
        the first tier; below it, where this tier holds its last copy that outlives a restart:
        the object would leave the cache, its pinned copy with it)."""
        st = self._st
        if st.keys.busy(key):
            return True
        entry = st.index.get(key)
        if entry is None or entry.moving:
            return True
        return key in st.pins and (self._pinnable
                                   or not st.lasting_elsewhere(entry, self._tier))

    async def run(self) -> None:
        st = self._st
        space = st.spaces[self._tier]
        batch = st.config.scheduler.eviction_batch
        loop = asyncio.get_running_loop()
        while True:
            await space.cue.wait()
            if (pause := self._resume_at - loop.time()) > 0:
                await asyncio.sleep(pause)  # moves out of here fail: the tier below recovers
            space.cue.clear()
            if space.waiting:
                # demotions out of this tier that wait for a lower tier's flush to drop their
                # copy here must not linger for company: a writer waits for that room
                for commit in st.commits[self._tier + 1:]:
                    commit.hurry()
            while not st.closing:
                need = space.to_free()
                if need <= 0:
                    if not (space.waiting and space.leaving == 0) or space.wake_fitting():
                        break  # enough is free or leaving; or room for a waiting writer now
                    need = 1  # a waiting write wants a contiguous run the byte count hides
                planned = False
                for plan in st.scheduler.departure_plans(self._tier, batch, self.protected,
                                                         st.index.get):
                    planned = True
                    self._start(plan)
                    need -= st.tiers[self._tier].footprint(plan.nbytes)
                    if need <= 0:
                        break
                if not planned:
                    if space.leaving == 0 and not self._room_coming():
                        space.starve()
                    break

    def _room_coming(self) -> bool:
        """Whether space may be freed without a plan: a janitor will delete orphans, or an
        operation in progress holds a key with a copy here (an overwrite deletes it, and once
        let go of it can be moved out: the release cues this evictor)."""
        st = self._st
        if st.keys.cleaning:
            return True
        for key in st.keys.busy_keys():
            entry = st.index.get(key)
            if entry is not None and self._tier in entry.locations:
                return True
        return False

    def _start(self, plan: Departure) -> None:
        st = self._st
        space = st.spaces[self._tier]
        entry = st.index.get(plan.key)
        assert entry is not None  # the scheduler planned from the index just now
        entry.moving = True
        footprint = st.tiers[self._tier].footprint(plan.nbytes)
        space.leaving += footprint

        def done(outcome: bool | None) -> None:
            space.leaving -= footprint
            if outcome is not None:
                self._failures = 0
                space.cue.set()  # more to free, or waiters to starve
                return
            # a failed move (the tier below failing, its breaker open): the evictor plans again
            # only after a pause, growing while moves go on failing. Cued at once (and by the
            # release of the victim's key, a writer waiting), it retried the same victims in a
            # loop that took a CPU whole (900,000 failed moves in 80 s) while writers waited
            self._failures += 1
            if self._failures <= FAILURES_BEFORE_PAUSE:  # a failure now and then: on at once
                space.cue.set()
                return
            pause = min(FAILED_MOVE_PAUSE * 2 ** min(self._failures - FAILURES_BEFORE_PAUSE - 1,
                                                     10), MAX_FAILED_MOVE_PAUSE)
            loop = asyncio.get_running_loop()
            self._resume_at = max(self._resume_at, loop.time() + pause)
            loop.call_later(pause, space.cue.set)

        self._executor.submit(plan, done, background=False)
