"""Running one plan: the moves between tiers, each durable by construction.

A move holds its key (`KeyGate`) for its whole run, but never waits for it: a key busy with a
put, delete, pin or another move when the plan comes to run is left alone (the plan is
discarded and the scheduler plans again later). It then checks the plan against the index (the
same entry, the same generation, the copies it expects) and discards it if anything changed; an
expiry's plan is also discarded if its object was read since it was made (`Scheduler.still_idle`).
The object stays readable from its source until the target copy is committed; the source copy
goes last, and when the source was persistent only after the target's copy is on media (a
flush of the target, shared with other moves and puts through group commit). A move that fails
leaves the source in place.

A demotion out of a persistent tier comes back from `run` as `Settling` once its target copy is
committed: the wait for the target's flush holds neither the key (a put or delete of it goes on
meanwhile) nor one of the executor's workers (so the workers keep copying while flushes run, and
one flush covers many demotions instead of one per worker); `settle` then waits, takes the key
again and drops the source if the entry is still the one moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.engine._copies import CopyOps
from tierkv.engine._departed import DepartedEdges
from tierkv.engine._index import IndexEntry
from tierkv.engine._keys import Claim
from tierkv.engine._state import EngineState
from tierkv.errors import DeviceError, TierFullError
from tierkv.scheduler import Demote, Drop, Evict, Plan, Promote, Share, departs_from

if TYPE_CHECKING:
    from opentelemetry.trace import Span

@dataclass(slots=True, eq=False)
class Settling:
    """A demotion whose target copy is committed but maybe not yet on media; its source (the
    persistent copy) stays until `Moves.settle` has seen the target flushed."""

    entry: IndexEntry
    plan: Demote
    placed: int


class Moves:
    __slots__ = ("_copies", "_departed", "_st")

    def __init__(self, state: EngineState, copies: CopyOps, departed: DepartedEdges) -> None:
        self._st = state
        self._copies = copies
        self._departed = departed

    async def run(self, plan: Plan, *, background: bool, parent: Span | None = None,
                  flushes: int | None = None) -> bool | Settling:
        """Carry out `plan`; False if it was discarded (the object changed or was busy), a
        `Settling` for `settle` when what remains is to wait for the target's flush.
        A copy waits for its bytes in the budgets first: every move's in `budget`, a
        `background` one's (no write waits for it) in `background_budget` too. Traced as a
        child of `parent`, the span of the call that planned it, if any (`_tracing`).
        `flushes`: the flushes begun when the plan was made (`_promote`; None: now)."""
        if flushes is None:
            flushes = self._st.flushes_begun
        tracing = self._st.tracing
        if tracing is None:
            return await self._run(plan, background, flushes)
        with tracing.move(plan, background, parent) as span:
            moved = await self._run(plan, background, flushes)
            span.set_attribute("tierkv.moved", moved is not False)
            span.set_attribute("tierkv.waits_for_flush", isinstance(moved, Settling))
            return moved

    async def _run(self, plan: Plan, background: bool, flushes: int) -> bool | Settling:
        st = self._st
        if isinstance(plan, Demote | Promote | Share):
            if background and st.background_budget.rate is not None:
                await st.background_budget.take(plan.nbytes)
            if st.budget.rate is not None:
                await st.budget.take(plan.nbytes)
        entry = st.index.get(plan.key)
        if entry is None or entry.generation != plan.generation or st.keys.busy(plan.key):
            return False
        async with st.keys.hold(plan.key) as claim:
            if st.index.get(plan.key) is not entry:
                return False
            if isinstance(plan, Promote):
                return await self._promote(entry, plan, claim, flushes)
            if isinstance(plan, Share):
                return await self._share(entry, plan, claim)
            if departs_from(plan) == 0 and plan.key in st.pins:
                return False  # pinned since the plan was made: its first-tier copy stays
            if not st.scheduler.still_idle(plan):
                return False  # an expiry's, and the object was read since: it stays
            if isinstance(plan, Demote):
                return await self._demote(entry, plan, claim)
            return await self._leave(entry, plan, claim)

    async def _leave(self, entry: IndexEntry, plan: Evict | Drop, claim: Claim) -> bool:
        st = self._st
        tier = plan.tier
        if tier not in entry.locations:
            return False
        if isinstance(plan, Evict) and not any(t > tier for t in entry.locations):
            return False  # the lower copy is gone: the next plan demotes instead
        doomed = [tier]
        if isinstance(plan, Drop) and not st.lasting_elsewhere(entry, tier):
            # The object leaves the cache, as a drop means: copies in volatile tiers above go
            # too (first, so reads fall through to this one meanwhile). Kept, they served an
            # object a crash then lost: a flush or a write-through put undone.
            doomed = [t for t in entry.locations if t != tier] + doomed
            if len(doomed) > 1 and plan.key in st.pins:
                return False  # pinned since the plan was made: it stays, with its copy here
        if len(doomed) == len(entry.locations) and st.tiers[tier].persistent:
            # its last copy, on media: the edges it keeps for its children go on media first
            async with self._departed.leaving(entry.key):
                if entry.detached or sorted(entry.locations) != sorted(doomed):
                    return False
                dropped = await self._remove(entry, doomed, claim)
        else:
            dropped = await self._remove(entry, doomed, claim)
        if dropped:
            st.counters.drops += 1
        return True

    async def leave_stranded(self, entry: IndexEntry) -> None:
        """A tier dropped this object's last lasting copy for room (the nvme log's reclaim):
        it leaves the cache, its volatile copies too, as `_leave` makes a drop's object leave
        (`EngineState.dropped`), unless it changed meanwhile (written again, a lasting copy
        made, pinned: it stays)."""
        st = self._st
        async with st.keys.hold(entry.key) as claim:
            if (st.index.get(entry.key) is not entry or entry.key in st.pins
                    or st.lasting_elsewhere(entry, None)):
                return
            if await self._remove(entry, list(entry.locations), claim):
                st.counters.drops += 1

    async def _remove(self, entry: IndexEntry, tiers: list[int], claim: Claim) -> bool:
        """Remove `entry`'s copies in `tiers`, in order; whether the last removal was the
        object's last copy."""
        st = self._st
        last = False
        for tier in tiers:
            last = await self._copies.remove(entry, tier, claim)
            st.counters.evictions[st.names[tier]] += 1
        return last

    async def _demote(self, entry: IndexEntry, plan: Demote, claim: Claim) -> bool | Settling:
        st = self._st
        source = plan.source
        if source not in entry.locations:
            return False
        if any(t > source and t != st.scheduler.shared for t in entry.locations):
            return await self._leave(entry, Evict(plan.key, plan.generation, plan.nbytes,
                                                  source), claim)
        placed: int | None = None
        async with self._copies.borrow(entry, source) as payload:
            if payload is None:
                return False
            try:
                placed = await self._copies.store(entry, payload, plan.target, claim)
            except (TierFullError, DeviceError):
                if plan.target != st.scheduler.shared:
                    raise
        if placed is None:
            # The shared tier refused it (down, full, a value over its limit): the object
            # leaves as the last local tier's victims do, a drop. The shared tier is a cache
            # beside the fleet's, never a durable copy to wait for; kept, the victim jammed the
            # tier above it, the evictor retried it, and every put waited and failed with
            # TierFullError for as long as the server refused.
            return await self._leave(entry, Drop(plan.key, plan.generation, plan.nbytes, source),
                                     claim)
        if entry.detached:
            return False
        st.counters.moved_bytes += plan.nbytes
        if st.tiers[source].persistent:
            # the source is the only durable copy until the target's is on media too
            return Settling(entry, plan, placed)
        await self._copies.remove(entry, source, claim)
        self._demoted(plan, placed)
        return True

    async def settle(self, settling: Settling, *, linger: float) -> bool:
        """Finish a demotion out of a persistent tier: wait until a flush of the target covers
        its copy (one that may wait `linger` seconds for more callers), then drop the source,
        unless the entry changed meanwhile (then whatever changed it dealt with both copies).
        A failed flush raises and keeps the source."""
        st = self._st
        entry, plan, placed = settling.entry, settling.plan, settling.placed
        await st.commits[placed].sync(linger=linger)
        if st.keys.busy(plan.key):
            # An operation holds the key (an overwrite, a delete) and may be waiting for the
            # room this departure frees: waiting for the key here held both until the writer's
            # `space_timeout`. Both copies stay (a valid, inclusive state); the evictor, cued as
            # the move ends, picks another victim, and the operation deals with both copies.
            return False
        async with st.keys.hold(plan.key) as claim:
            # without the target's copy (a failed write dropped it, its error raised to an
            # earlier flush: the one that returned here covered none of it) the source stays
            if (st.index.get(plan.key) is not entry or entry.detached
                    or placed not in entry.locations or plan.source not in entry.locations):
                return False
            await self._copies.remove(entry, plan.source, claim)
        self._demoted(plan, placed)
        return True

    def _demoted(self, plan: Demote, placed: int) -> None:
        st = self._st
        source = plan.source
        st.counters.demotions[st.names[placed]] += 1
        st.counters.demoted_bytes[st.names[placed]] += plan.nbytes
        st.read_bytes[source] += plan.nbytes
        st.counters.evictions[st.names[source]] += 1

    async def _promote(self, entry: IndexEntry, plan: Promote, claim: Claim,
                       flushes: int) -> bool:
        st = self._st
        if plan.target in entry.locations or plan.source not in entry.locations:
            return False
        space = st.spaces[plan.target]
        if space.wanted or not st.tiers[plan.target].fits(plan.nbytes):
            # best effort: room first (and for the puts waiting for it: a promotion must not
            # take the room the evictor frees for them), a later hit promotes
            space.cue.set()
            return False
        got = await self._copies.read(entry, plan.source)
        if got is None:
            return False
        if not await self._copies.store_in(entry, got[1], plan.target, claim, wait=False):
            return False
        # exclusive: the source goes, unless a flush began since the hit that asked for the
        # move or runs now: that flush may have found the object durable (its listing came
        # first), and returned with its only copy in the first tier (write-back, exclusive:
        # 14 to 35 of 100 objects read before a flush() missing after a kill -9 right after
        # it). Kept, the copy leaves that tier as any other, by eviction.
        if (plan.exclusive and plan.source in entry.locations and not entry.detached
                and flushes == st.flushes_begun and not st.flushing):
            await self._copies.remove(entry, plan.source, claim)
            st.counters.evictions[st.names[plan.source]] += 1
        st.counters.moved_bytes += plan.nbytes
        st.counters.promotions[st.names[plan.target]] += 1
        st.counters.promoted_bytes[st.names[plan.target]] += plan.nbytes
        st.read_bytes[plan.source] += plan.nbytes
        return True

    async def _share(self, entry: IndexEntry, plan: Share, claim: Claim) -> bool:
        """Copy a put's object into the shared tier, keeping every local copy. Best effort: a
        shared tier that is full or down leaves the object local (a later put shares again)."""
        st = self._st
        if plan.target in entry.locations or plan.source not in entry.locations:
            return False
        async with self._copies.borrow(entry, plan.source) as payload:
            if payload is None:
                return False
            try:
                stored = await self._copies.store_in(entry, payload, plan.target, claim,
                                                     wait=False)
            except DeviceError:  # the server is down or slow: the object stays local
                st.counters.device_errors += 1
                return False
            if not stored:
                return False
        st.counters.shared[st.names[plan.target]] += 1
        st.counters.shared_bytes[st.names[plan.target]] += plan.nbytes
        st.read_bytes[plan.source] += plan.nbytes
        return True
