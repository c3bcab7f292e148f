"""The engine's background tasks: each tier's evictor and idle expiry, and the health watch.

Started once the tiers are open; `close` ends the expiry first (no new idle moves while the
engine drains), then the rest once everything is flushed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from tierkv.config.schema import idle_ttl
from tierkv.engine._evictor import Evictor
from tierkv.engine._executor import MoveExecutor
from tierkv.engine._expiry import expire_idle
from tierkv.engine._state import EngineState

#: seconds between two looks at the circuit breakers and the miss-storm detector
HEALTH_POLL = 1.0


class Background:
    def __init__(self, state: EngineState, executor: MoveExecutor,
                 ticks: Sequence[Callable[[], None]] = ()) -> None:
        self._st = state
        self._executor = executor
        #: called by the health watch every second too (no await: each starts its own work)
        self._ticks = tuple(ticks)
        self.evictors = [Evictor(state, i, executor) for i in range(len(state.tiers))]
        self._evictions: list[asyncio.Task[None]] = []
        self._expiries: list[asyncio.Task[None]] = []
        self._health: list[asyncio.Task[None]] = []

    def start(self) -> None:
        st = self._st
        for index, space in enumerate(st.spaces):
            if space.watermarks is not None:
                self._evictions.append(asyncio.create_task(self.evictors[index].run()))
                space.cue.set()  # a recovered tier may start above its watermark
        for index, tier_config in enumerate(st.config.tiers):
            if (ttl := idle_ttl(tier_config)) is not None:
                self._expiries.append(asyncio.create_task(expire_idle(
                    st, self._executor, self.evictors[index], index, ttl)))
        self._health.append(asyncio.create_task(self._watch_health()))

    async def _watch_health(self) -> None:
        """Ask each breaker its state every second: an open one past its cool-down turns
        half-open, and the scheduler plans puts and moves into its tier again (its probes).
        The miss-storm detector is asked too, so that it sees a storm end while misses are
        rare."""
        while True:
            await asyncio.sleep(HEALTH_POLL)
            for guard in self._st.guards:
                guard.poll()
            self._st.misses.check()
            for tick in self._ticks:
                tick()

    async def stop_expiry(self) -> None:
        await _cancel(self._expiries)

    async def stop(self) -> None:
        await _cancel([*self._evictions, *self._expiries, *self._health])


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
