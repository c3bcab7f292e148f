"""The migration executor: plans run as background tasks, a bounded number at once.

`submit` starts a task per plan and returns at once; at most `migration_concurrency` of them
move data at a time (the rest wait their turn), and together they respect the byte budget
(`_budget`). A task is never cancelled because some caller stopped waiting; `drain` waits for
all of them (close). What each plan does is `_moves`; a failure is logged and counted, and the
plan's object is set at the young end of its tier's policy so that the evictor tries other
victims before it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tierkv.engine._moves import Moves
from tierkv.engine._state import EngineState
from tierkv.errors import TierKVError
from tierkv.scheduler import Plan, Promote, departs_from

log = logging.getLogger("tierkv.engine")

#: called on the loop when a plan's task ends: whether the plan was carried out
Done = Callable[[bool], None]


class MoveExecutor:
    def __init__(self, state: EngineState, moves: Moves) -> None:
        self._st = state
        self._moves = moves
        self._turns = asyncio.Semaphore(state.config.scheduler.migration_concurrency)
        self.in_flight = 0

    def submit(self, plan: Plan, done: Done | None = None) -> None:
        """Run `plan` in the background; its entry must already be marked `moving`."""
        self.in_flight += 1
        self._st.spawn(self._run(plan, done))

    async def _run(self, plan: Plan, done: Done | None) -> None:
        st = self._st
        carried_out = failed = False
        try:
            async with self._turns:
                carried_out = await self._moves.run(plan)
        except TierKVError as exc:
            failed = True
            st.counters.moves_failed += 1
            log.warning("moving an object failed, it stays where it was: %s", exc)
            tier = plan.source if isinstance(plan, Promote) else departs_from(plan)
            st.scheduler.accessed(tier, plan.key, st.now())
        finally:
            self.in_flight -= 1
            entry = st.index.get(plan.key)
            if entry is not None and entry.generation == plan.generation:
                entry.moving = False
            if not carried_out and not failed:
                st.counters.moves_discarded += 1
            if done is not None:
                done(carried_out)
