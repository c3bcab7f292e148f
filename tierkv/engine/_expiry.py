"""Time to live per tier: objects idle for longer than a tier's `ttl` move down.

For each tier with a `ttl` (the gpu tier's defaults to 5 s, the others' to none), a background
task wakes a few times per `ttl`, asks the scheduler which objects of the tier have been idle
since before the cutoff, and submits their plans to the executor (a demotion, or only a delete
where a lower tier already holds a copy; in the last tier, a drop). Pinned and busy objects stay,
and so do objects the tiers below have no free room for (above their low watermarks): expiry
never pushes another object out of the cache, not even through an evictor it woke. A plan may
run long after it was made (expiry's moves are paced by `background_bandwidth`): each carries
its cutoff, and one whose object was read meanwhile is discarded when it runs (`_moves`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tierkv.engine._evictor import Evictor
from tierkv.engine._executor import MoveExecutor
from tierkv.engine._state import EngineState

log = logging.getLogger("tierkv.engine")


def _free_room(state: EngineState) -> Callable[[int], int]:
    """Footprint bytes a tier can take now without dropping or evicting anything
    (`Tier.room`: for the nvme log, its head's rest and its empty regions only), less its low
    watermark where it has one: room taken below that mark would start the tier's evictor,
    which pushes its own victims down and, in the end, out of the cache."""
    def room(tier: int) -> int:
        free = state.tiers[tier].room()
        marks = state.spaces[tier].watermarks
        return free if marks is None else max(free - marks.low, 0)

    return room


async def expire_idle(state: EngineState, executor: MoveExecutor, evictor: Evictor,
                      tier: int, ttl: float) -> None:
    interval = min(max(ttl / 4, 0.01), 1.0)
    while True:
        await asyncio.sleep(interval)
        if state.closing:
            return
        plans = state.scheduler.expired(tier, state.now() - ttl, evictor.protected,
                                        state.index.get, _free_room(state))
        for plan in plans:
            entry = state.index.get(plan.key)
            if entry is None:
                continue
            entry.moving = True

            def done(carried_out: bool | None) -> None:
                if carried_out:
                    state.counters.expired += 1

            executor.submit(plan, done, background=True)
