"""The migration executor: plans run as background tasks, a bounded number at once.

`submit` queues a plan and returns at once. Plans wait in lanes: one per tier for the departures
from it, one for promotions; each lane has `migration_concurrency` worker tasks taking its plans
in the order they came (all together respect the byte budget, `_budget`). A demotion into a full
tier waits for that tier's own departures, so those must never queue behind it: with one shared
queue, every worker could hold a gpu → pmem demotion waiting for pmem room while the pmem → nvme
demotions that would make the room sat behind them, until each timed out. A worker
is never cancelled because some caller stopped waiting; `drain` waits until every plan submitted
has ended (settle, close), `stop` ends the workers. What each plan does is `_moves`; a failure
is logged and counted, and the plan's object is set at the young end of its tier's policy so
that the evictor tries other victims before it again. A demotion out of a persistent tier lets
go of its worker once its copy is written (`_moves.Settling`): its wait for the target's flush
runs as a task of its own, counted in flight until it ends (the evictor's `leaving` bounds how
many there are).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.engine._moves import Moves, Settling
from tierkv.engine._state import EngineState
from tierkv.engine._tracing import current_call
from tierkv.errors import TierKVError
from tierkv.scheduler import Plan, Promote, Share, departs_from

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("tierkv.engine")

#: called on the loop when a plan's task ends: True if the plan was carried out, False if it
#: was given up (the object changed meanwhile), None if it failed
Done = Callable[[bool | None], None]


@dataclass(frozen=True, slots=True)
class _Submitted:
    """A plan as submitted: `done` to call when it ends, the span of the call that submitted it
    (`parent`), the flushes begun by then (`_moves.Moves.run`), its place in the order."""

    plan: Plan
    background: bool
    done: Done | None
    parent: Span | None
    flushes: int
    ticket: int


class _Lane:
    __slots__ = ("queue", "ready")

    def __init__(self) -> None:
        self.queue: deque[_Submitted] = deque()
        self.ready = asyncio.Event()


class MoveExecutor:
    """Fixed sets of `migration_concurrency` worker tasks, one set per lane, each taking plans
    first come first served (a task per plan cost more than many moves' own work on the loop)."""

    def __init__(self, state: EngineState, moves: Moves) -> None:
        self._st = state
        self._moves = moves
        #: lane i: departures from tier i; the last lane: promotions and shares (which never wait
        #: for room)
        self._lanes = [_Lane() for _ in range(len(state.tiers) + 1)]
        self._idle = asyncio.Event()
        self._idle.set()
        self._workers: list[asyncio.Task[None]] = []
        #: demotions waiting for their target's flush (strong references until they end)
        self._settling: set[asyncio.Task[None]] = set()
        #: the tickets of the plans submitted and not yet ended (queued or running), numbered
        #: in the order submitted: `drain(before=)` waits for those below a mark only
        self._open: set[int] = set()
        #: of them, departures (the evictors' and expiries' moves; not promotions, shares)
        self.departing = 0
        self._next_ticket = 0
        #: set (and replaced) whenever a plan ends
        self._progress = asyncio.Event()
        #: callers of `drain` waiting now
        self._draining = 0

    def start(self) -> None:
        count = self._st.config.scheduler.migration_concurrency
        loop = asyncio.get_running_loop()
        self._workers = [loop.create_task(self._work(lane))
                         for lane in self._lanes for _ in range(count)]

    def submit(self, plan: Plan, done: Done | None = None, *, background: bool) -> None:
        """Run `plan` in the background; its entry must already be marked `moving`.
        `background`: no write waits for it (expiry, promotion): it is paced by
        `background_bandwidth` too. Traced, the move's span descends from the traced call
        submitting it (`_tracing`)."""
        lane = self._lanes[-1 if isinstance(plan, Promote | Share) else departs_from(plan)]
        parent = None if self._st.tracing is None else current_call()
        ticket = self._next_ticket
        self._next_ticket += 1
        self._open.add(ticket)
        lane.queue.append(_Submitted(plan, background, done, parent, self._st.flushes_begun,
                                     ticket))
        self.departing += lane is not self._lanes[-1]
        self._idle.clear()
        lane.ready.set()

    @property
    def in_flight(self) -> int:
        """Plans submitted and not yet ended (queued or running)."""
        return len(self._open)

    def mark(self) -> int:
        """A mark for `drain(before=)`: the plans submitted so far are below it."""
        return self._next_ticket

    def open_before(self, mark: int) -> bool:
        """Whether a plan submitted before `mark` has not ended yet."""
        return bool(self._open) and min(self._open) < mark

    async def drain(self, *, before: int | None = None) -> None:
        """Wait until every plan submitted so far (those below the mark `before`) has ended.
        Meanwhile no demotion lingers for company in its target's flush (`_linger`): this
        caller waits for them all. Waiting for the executor to be idle instead, a caller never
        returned while another task's reads kept asking for promotions."""
        self._draining += 1
        try:
            for commit in self._st.commits:
                commit.hurry()
            if before is None:
                await self._idle.wait()
            while before is not None and self.open_before(before):
                await self._progress.wait()
        finally:
            self._draining -= 1

    async def drain_departures(self) -> None:
        """Wait until no departure is in flight (promotions and shares may be)."""
        self._draining += 1
        try:
            for commit in self._st.commits:
                commit.hurry()
            while self.departing:
                await self._progress.wait()
        finally:
            self._draining -= 1

    async def stop(self) -> None:
        """Drain, then end the workers (close)."""
        await self.drain()
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    async def _work(self, lane: _Lane) -> None:
        while True:
            while not lane.queue:
                lane.ready.clear()
                await lane.ready.wait()
            await self._run(lane.queue.popleft())

    async def _run(self, item: _Submitted) -> None:
        outcome: bool | Settling | None = None
        try:
            outcome = await self._attempt(
                self._moves.run(item.plan, background=item.background, parent=item.parent,
                                flushes=item.flushes), item.plan)
        finally:
            if isinstance(outcome, Settling):
                task = asyncio.get_running_loop().create_task(self._settle(outcome, item))
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)
            else:
                self._ended(item, outcome)

    async def _settle(self, settling: Settling, item: _Submitted) -> None:
        outcome = None
        try:
            outcome = await self._attempt(
                self._moves.settle(settling, linger=self._linger(settling)), item.plan)
        finally:
            self._ended(item, outcome)

    def _linger(self, settling: Settling) -> float:
        """How long the target's flush may wait for more demotions before it covers this one
        (`demotion_linger`): the source stays a little longer, and one flush covers many.
        None while someone waits for the demotion: `drain`, or a writer wanting the room its
        source frees (the evictor hurries a flush already lingering when one starts to)."""
        st = self._st
        if self._draining or st.spaces[settling.plan.source].waiting:
            return 0.0
        return st.config.engine.demotion_linger

    async def _attempt(self, move: Awaitable[bool | Settling],
                       plan: Plan) -> bool | Settling | None:
        """`move`'s outcome; ``None`` if it failed (logged, counted)."""
        st = self._st
        try:
            return await move
        except TierKVError as exc:
            st.counters.moves_failed += 1
            log.warning("moving an object failed, it stays where it was: %s", str(exc))
            tier = plan.source if isinstance(plan, Promote | Share) else departs_from(plan)
            st.scheduler.accessed(tier, plan.key, st.now())
        except Exception:  # a defect: keep the worker, say where
            st.counters.moves_failed += 1
            log.exception("a move failed unexpectedly; the object stays where it was")
        return None

    def _ended(self, item: _Submitted, outcome: bool | Settling | None) -> None:
        """A plan's last step, whichever way it ended (``None``: failed or cancelled)."""
        st = self._st
        plan, done = item.plan, item.done
        self._open.discard(item.ticket)
        if not self._open:
            self._idle.set()
        self.departing -= not isinstance(plan, Promote | Share)
        self._progress.set()
        self._progress = asyncio.Event()
        entry = st.index.get(plan.key)
        if entry is not None and entry.generation == plan.generation:
            entry.moving = False
        if outcome is False:
            st.counters.moves_discarded += 1
        if done is not None:
            done(None if outcome is None else outcome is True)
