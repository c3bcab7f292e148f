"""What the engine's parts share: tiers, index, scheduler, key gate, space, commits, counters.

`EngineState` is built once by `Engine` and handed by reference to each part (reads, writes,
moves, evictors, flush, pins, recovery), as the nvme tier's layers share its `LogState`. It
holds no logic beyond starting and tracking the engine's background tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tierkv.config import Config, GpuTierConfig, PmemTierConfig, TierConfig, TierKind, WritePolicy
from tierkv.config.schema import (
    DEFAULT_FREE_HIGH,
    DEFAULT_FREE_LOW,
    RedisTierConfig,
    idle_ttl,
)
from tierkv.engine._budget import ByteBudget
from tierkv.engine._commit import GroupCommit
from tierkv.engine._guard import Guard
from tierkv.engine._index import Index, IndexEntry
from tierkv.engine._keys import KeyGate, Scrub
from tierkv.engine._latency import Latencies
from tierkv.engine._space import TierSpace
from tierkv.engine._storms import MissWatch
from tierkv.engine._tracing import Tracing, tracer_for
from tierkv.engine.dag import Dag
from tierkv.engine.stats import EngineCounters
from tierkv.errors import DeviceError, EngineClosedError, TierUnavailableError
from tierkv.formats.membership import Membership
from tierkv.health import BreakerState
from tierkv.keys import is_engine_key
from tierkv.scheduler import Scheduler
from tierkv.tiers.base import Tier, ZeroCopyPinning

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger("tierkv.engine")


class EngineState:
    def __init__(self, config: Config, tiers: tuple[Tier, ...],
                 clock: Callable[[], float] = time.monotonic,
                 tracer_provider: TracerProvider | None = None) -> None:
        self.config = config
        #: the time policy sees (access times, decay, TTL); a replay passes a virtual clock
        self.now = clock
        self.tiers = tiers
        self.names = tuple(tier.name for tier in tiers)
        #: each tier as `ZeroCopyPinning` where it is one (checked once: a runtime protocol check
        #: costs tens of microseconds, and moves out of the gpu tier ask on every move)
        self.pinning: tuple[ZeroCopyPinning | None, ...] = tuple(
            tier if isinstance(tier, ZeroCopyPinning) else None for tier in tiers)
        self.scheduler = Scheduler(
            tiers, config.scheduler, [tier.capacity for tier in tiers],
            keep_lower_copies=config.engine.write_policy is WritePolicy.WRITE_THROUGH,
            ttls=[idle_ttl(tier) for tier in config.tiers])
        self.dag = Dag()
        self.index = Index([tier.persistent for tier in tiers], self.scheduler, self.dag,
                           self.scheduler.shared, in_use=self.in_use)
        self.counters = EngineCounters()
        #: get and put latency histograms, the miss-storm watch (fed by the engine's gets) and
        #: the spans (None: no tracer installed, nothing traced)
        self.latency = Latencies(len(tiers))
        #: payload bytes read out of each tier, by index: gets it served, and the copies
        #: promotions, demotions and shares made from it (a list, not a `Counter` by name:
        #: every get adds to it)
        self.read_bytes = [0] * len(tiers)
        self.misses = MissWatch(config.health, clock)
        tracer = tracer_for(tracer_provider)
        self.tracing = None if tracer is None else Tracing(tracer, self.names)
        #: called (on the loop, no await) when an overwriting put failed or was cancelled after
        #: it removed the old value: the engine invalidates what derived from it (`engine`)
        self.lost_overwrite: Callable[[bytes], None] | None = None
        #: objects the engine keeps for itself in persistent tiers (never indexed): key → the
        #: tiers holding one (more than one where deleting an older one failed)
        self.own: dict[bytes, list[int]] = {}
        #: called (on the loop, no await) when a persistent tier failed to delete a key's copy
        #: that the index no longer lists (`_tombstones`)
        self.refused_delete: Callable[[bytes, int], None] | None = None
        #: called (on the loop, no await) when the shared tier failed to delete a key's object
        #: (`_shared`: kept as an invalidation to publish, and never adopted meanwhile)
        self.refused_shared_delete: Callable[[bytes], None] | None = None
        #: live pins per key (`_pins`): such a key's first-tier copy neither moves nor leaves
        self.pins: dict[bytes, int] = {}
        self.budget = ByteBudget(config.scheduler.migration_bandwidth)
        self.background_budget = ByteBudget(config.scheduler.background_bandwidth)
        self.tasks: set[asyncio.Task[None]] = set()
        #: the cleanup of cancelled writes (`CopyOps.scrub`), installed by the engine
        self.scrub: Scrub | None = None
        #: what makes objects a tier dropped the last lasting copies of for room leave the
        #: cache (`Moves.leave_stranded`), installed by the engine; its runs, which a flush
        #: waits for before it counts what it wrote and lost (`stranding`)
        self.leave_stranded: Callable[[IndexEntry], Coroutine[Any, Any, None]] | None = None
        self.stranding: set[asyncio.Task[None]] = set()
        #: by engine record, told of the tier that dropped it on its own (a reclaim of the log
        #: that found no room to keep it), which writes it again (`_membership`, at once) or
        #: marks it unwritten (`_departed`, `_tombstones`: the next flush writes it)
        self.record_dropped: dict[bytes, Callable[[int], None]] = {}
        #: this session's membership records a tier has not taken yet, by tier (`_membership`)
        self.unrecorded: dict[int, Membership] = {}
        self.keys = KeyGate(self._scrub, self.spawn, self._released)
        #: parents named by puts in progress, by count of puts (`linking`)
        self._linking: Counter[bytes] = Counter()
        self.spaces = tuple(
            TierSpace(tier, self._watermarks(tier, tier_config), config.engine.space_timeout)
            for tier, tier_config in zip(tiers, config.tiers, strict=True)
        )
        #: each tier's circuit breaker, through which every call into the tier goes
        self.guards = tuple(
            Guard(index, tier.name, config.health, self._breaker_changed,
                  direct=tier.kind is TierKind.GPU, deferred=tier.kind is TierKind.NVME)
            for index, tier in enumerate(tiers))
        group = config.engine.group_commit
        self.commits = tuple(GroupCommit(functools.partial(self._flush_tier, index),
                                         enabled=group) for index in range(len(tiers)))
        #: keys whose write-through put waits for its copy's flush: a reclaim of the log
        #: keeps their entries (`_recovery.listen_to_tiers`), lest the put lose its copy
        #: between its write and the flush that makes it durable
        self.syncing: set[bytes] = set()
        #: flushes begun so far, and whether one runs now: an exclusive promotion asked for
        #: before a flush began, or ending while one runs, keeps its durable source (`_moves`)
        self.flushes_begun = 0
        self.flushing = False
        #: public calls in progress, and the event close waits on for them to end
        self.active = 0
        self.quiet = asyncio.Event()
        self.quiet.set()
        self.closing = False

    @staticmethod
    def _watermarks(tier: Tier, config: TierConfig) -> tuple[float, float] | None:
        if isinstance(config, RedisTierConfig):
            return DEFAULT_FREE_LOW, DEFAULT_FREE_HIGH
        if tier.reclaims_space or not isinstance(config, GpuTierConfig | PmemTierConfig):
            return None
        return config.free_low, config.free_high

    def _breaker_changed(self, tier: int, state: BreakerState) -> None:
        """No put or move is planned into a tier whose breaker is open; a half-open one takes
        them again, and those calls are its probes."""
        self.scheduler.usable[tier] = state is not BreakerState.OPEN
        self.counters.breaker_transitions[f"{self.names[tier]}:{state.value}"] += 1
        if state is not BreakerState.OPEN:
            self.spaces[tier].cue.set()

    def device_failed(self, tier: int, what: str, exc: DeviceError) -> None:
        """Count a failed call into `tier` (`what` it failed), and log it unless the tier was
        skipped for an open breaker (which the breaker logged once when it opened)."""
        if isinstance(exc, TierUnavailableError):
            self.counters.breaker_skips += 1
            return
        self.counters.device_errors += 1
        log.warning("tier %s failed %s: %s", self.names[tier], what, str(exc))

    async def _flush_tier(self, index: int) -> None:
        """One flush of tier `index` (its `commits`); a failed one is counted once, however
        many callers it served."""
        try:
            await self.guards[index].settle(self.tiers[index].flush)
        except DeviceError as exc:
            self.device_failed(index, "a flush", exc)
            raise

    async def _scrub(self, key: bytes, dirty: set[int]) -> None:
        assert self.scrub is not None, "the engine installs the scrub before any operation"
        await self.scrub(key, dirty)

    def _released(self) -> None:
        """A key was let go of: its copies may be moved out again, so the evictors of tiers
        that writers wait for look once more."""
        for space in self.spaces:
            if space.waiting:
                space.cue.set()

    def in_use(self, key: bytes) -> bool:
        """Whether `key` has an object, or an operation holds it (a put of it may be about to
        commit, with the parents it just set): the DAG keeps such a key's edges."""
        return key in self.index or self.keys.busy(key) or key in self._linking

    @contextlib.contextmanager
    def linking(self, parents: Sequence[bytes]) -> Iterator[None]:
        """For a put naming `parents`, from before its cascade until it linked them: they
        count as in use, so the DAG keeps their own edges from their parents. The cascade of
        the key's old value released a parent it left without children (a key holding no
        object that `add_dependency` had hung under another) before the put linked it, and an
        invalidation of that grandparent then missed the new value. A parent the put did not
        link after all (it failed) is released as it would have been."""
        self._linking.update(parents)
        try:
            yield
        finally:
            for parent in parents:
                self._linking[parent] -= 1
                if not self._linking[parent]:
                    del self._linking[parent]
                    if not self.in_use(parent):
                        self.index.unlink(parent)

    def dropped(self, tier: int, keys: Sequence[bytes], for_room: bool = False) -> None:
        """`tier` dropped these keys' copies on its own (called as it drops them): the index
        forgets them; an engine record goes to `record_dropped`. Dropped `for_room` (a reclaim),
        a copy that was its object's last lasting one while volatile tiers hold the object:
        the object leaves the cache (`leave_stranded`), as a drop out of the last tier makes it
        (`Moves._leave`). Kept there, it stayed served while a crash would lose it: a flush or
        a write-through put silently undone, and with more volatile than lasting room a flush
        wrote it again and again, each time dropping others, and raised for good."""
        stranded: list[IndexEntry] = []
        for key in keys:
            if is_engine_key(key):
                listener = self.record_dropped.get(key)
                if listener is not None:
                    listener(tier)
                continue
            entry = self.index.get(key)
            if entry is not None and tier in entry.locations:
                # a copy that left its tier for room: an eviction, as the evictor's are
                self.counters.evictions[self.names[tier]] += 1
                if self.index.remove_copy(entry, tier):
                    self.counters.drops += 1
                elif (for_room and self.tiers[tier].persistent and key not in self.pins
                      and not self.lasting_elsewhere(entry, tier)):
                    stranded.append(entry)
        if self.leave_stranded is None or self.closing:
            # at close the volatile copies go with the engine: the objects leave the cache
            # here, and count as dropped (uncounted, a reopen found them gone unaccounted for)
            self.counters.drops += len(stranded)
            return
        for entry in stranded:  # one task each: a key held long holds up no other
            task = self.spawn(self.leave_stranded(entry))
            self.stranding.add(task)
            task.add_done_callback(self.stranding.discard)

    def lasting_elsewhere(self, entry: IndexEntry, tier: int | None) -> bool:
        """Whether a copy of `entry` other than `tier`'s (any, for None) outlives a restart
        (in a persistent tier, or in the shared one)."""
        shared = self.scheduler.shared
        return any(self.tiers[t].persistent or t == shared for t in entry.locations
                   if t != tier)

    def check_open(self) -> None:
        if self.closing:
            raise EngineClosedError("the engine is closed")

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `coroutine` in the background; close waits for it."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("a background task of the engine failed", exc_info=error)

    async def drain_tasks(self) -> None:
        while self.tasks:
            await asyncio.wait(set(self.tasks))
