"""The engine: the public async API over the index, the tiers and the background moves.

Ownership. The engine alone owns "where is key K" (`_index`); tiers store bytes for the keys they
are told about (`tierkv.tiers`), the scheduler decides (`tierkv.scheduler`), the engine executes.

Concurrency. Everything runs on one event loop, and no lock is held across device IO but a
key's own: operations on one key (put, delete, pin, each background move) run one at a time in
the order they asked (`_keys`), operations on different keys run concurrently down to the device
queues. Gets take no lock at all (`_reads`). Every index change commits on the loop after its
IO, in one step, checked against the entry it was made for; a change that lost a race is
discarded and its copy deleted. Space is kept ahead of demand: a background evictor per tier
moves victims down when free space falls below the tier's low watermark (`_evictor`,
`_executor`, `_moves`); a put that finds its tier full waits for that (`_space`), it never
evicts itself. Write-through puts share flushes (`_commit`).

Cancellation. Every public coroutine may be cancelled at any await: a cancelled put leaves the
key with no value or the new one and every other key untouched, a cancelled get leaves nothing
behind, and background work is never cancelled because a caller stopped waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, TypeVar

import torch

from tierkv.config import Config, GpuTierConfig
from tierkv.engine._background import Background
from tierkv.engine._call import Call as _Call
from tierkv.engine._copies import CopyOps
from tierkv.engine._departed import DepartedEdges
from tierkv.engine._executor import MoveExecutor
from tierkv.engine._flush import Flusher
from tierkv.engine._invalidate import Invalidations
from tierkv.engine._items import checked_puts, put_chains, put_parents
from tierkv.engine._membership import insist_on_records
from tierkv.engine._moves import Moves
from tierkv.engine._observe_calls import ObserveCalls
from tierkv.engine._pins import PinContext, Pins
from tierkv.engine._profiles import measure_profiles
from tierkv.engine._read_calls import ReadCalls
from tierkv.engine._reads import Reads
from tierkv.engine._recovery import cut_off_by_damage, open_tiers
from tierkv.engine._shared import Shared
from tierkv.engine._slo import slo_seconds
from tierkv.engine._state import EngineState, log
from tierkv.engine._tombstones import Tombstones
from tierkv.engine._tracing import DELETE, FLUSH, INVALIDATE, INVALIDATE_MODEL, PUT, PUT_MANY
from tierkv.engine._writes import Writes
from tierkv.errors import EngineClosedError
from tierkv.formats.header import check_header
from tierkv.formats.value import Value, encode_value
from tierkv.keys import Key, encode_key, version_key
from tierkv.tiers.base import Tier

if TYPE_CHECKING:
    from opentelemetry.trace import Span, TracerProvider

KeyT = TypeVar("KeyT", bound=Key)
ValueT = TypeVar("ValueT", bound=Value)


class Engine(ReadCalls, ObserveCalls):
    """A tiered object store; build it with `tierkv.open(config)`."""

    def __init__(self, config: Config, tiers: Sequence[Tier],
                 clock: Callable[[], float] = time.monotonic, *,
                 tracer_provider: TracerProvider | None = None) -> None:
        self.config = config
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self._st = st = EngineState(config, self.tiers, clock, tracer_provider)
        self._departed = DepartedEdges(st)
        copies = CopyOps(st, self._departed)
        st.scrub = copies.scrub
        moves = Moves(st, copies, self._departed)
        st.leave_stranded = moves.leave_stranded
        self._executor = MoveExecutor(st, moves)
        self._shared = Shared(st, self._executor)
        self._reads = Reads(st, copies, self._executor, self._shared)
        self._writes = Writes(st, copies, self._departed)
        self._tombstones = Tombstones(st, copies)
        self._flusher = Flusher(st, copies, self._tombstones, self._departed)
        self._invalidations = Invalidations(st, self._writes, self._shared)
        st.lost_overwrite = self._lost_overwrite
        self._pins = Pins(st, copies)
        self._background = Background(st, self._executor,
                                      ticks=(self._shared.tick, self._tombstones.tick))
        self._one_call = _Call(st)
        self._one_write = _Call(st, writes=True)
        #: one profile probe at a time (the first puts with a latency SLO)
        self._profiling = asyncio.Lock()
        self._closed = True  # until `_start` has opened the tiers
        #: the one close, which every `close` call waits for
        self._closing: asyncio.Future[None] | None = None
        first = config.tiers[0]
        self.device = (getattr(self.tiers[0], "device", torch.device("cpu"))
                       if isinstance(first, GpuTierConfig) else torch.device("cpu"))

    # -- lifecycle -------------------------------------------------------------------------------
    async def _start(self) -> None:
        """Open every tier, index what the persistent ones recovered, start the background."""
        st = self._st
        unrecorded = await open_tiers(st)
        try:
            await self._tombstones.recover()
            await self._departed.recover()
            self._closed = False
            self._executor.start()
            self._background.start()
            await insist_on_records(st, unrecorded)
            for key in cut_off_by_damage(st, self._departed.lost_at_open):
                removed = await self._invalidations.descendants(key, local=True, barrier=False)
                log.warning("recovery: %d objects derive from a damaged object whose parents "
                            "are unknown: removed", removed)
            await self._shared.start(self._invalidations.forget)
        except BaseException:
            # an open cut short once the tiers were open (cancelled, the shared tier failing while
            # its log is read): nobody gets this engine to close it, so what it started ends here
            # and the tiers let go of their media (left open, later opens found them in use)
            self._closed = True
            await self._shared.stop()
            await self._executor.drain()
            await st.drain_tasks()  # the scrub of a delete the cancel cut short, say
            await self._stop_started()
            raise

    async def _stop_started(self) -> None:
        """End the background work and close the tiers (the end of a close, and of an open
        cut short)."""
        st = self._st
        st.closing = True
        for space in st.spaces:
            space.close()
        await self._background.stop()
        await self._executor.stop()
        await st.drain_tasks()  # a record a tier dropped at the last flush, written again
        for tier in self.tiers:
            await tier.close()

    def _lost_overwrite(self, key: bytes) -> None:
        """An overwriting put failed after it removed the old value: in the background, remove
        what derived from the old value and tell the fleet (whose copies of it, the shared
        tier's included, must not be read again), as a put that succeeded would have."""
        async def invalidate() -> None:
            await self._invalidations.descendants(key, barrier=False)

        self._st.spawn(invalidate())

    async def close(self) -> None:
        """Finish what is in flight, flush to the persistent tiers (so a restart finds the
        cache), then close them. Idempotent: every call, concurrent or later, waits for the
        one close and raises what it raised; a caller cancelled meanwhile stops waiting, not
        the close, which goes on in the background."""
        self._one_call.check_loop()
        if self._closing is None:
            if self._closed:
                return  # never opened
            self._closed = True  # new calls are refused from here on
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        st = self._st
        try:
            # calls in progress end; the evictors still run, so writes waiting for room get it
            await st.quiet.wait()
            await self._shared.stop()
            await self._background.stop_expiry()
            # moves go unpaced: a backlog would hold the close backlog / rate s (the flush
            # below is not paced either); `migration_bandwidth` paces demotions too
            st.background_budget.lift()
            st.budget.lift()
            await self._executor.drain()  # moves already planned
            await st.drain_tasks()  # cleanups of cancelled operations
            await self._flusher.flush()  # may wait for room below: the evictors still run
            await self._executor.drain()
            await st.drain_tasks()
            await self._shared.save_cursor()
        finally:
            await self._stop_started()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn("a tierkv engine was never closed", ResourceWarning, stacklevel=1)

    def _call(self, *, write: bool = False) -> _Call:
        """One public call (`write`: a put or delete, which gives the loop turns: `_call`):
        refused once the engine is closed; `close` waits for it to end."""
        if self._closed:
            raise EngineClosedError("the engine is closed")
        return self._one_write if write else self._one_call

    # -- writes ----------------------------------------------------------------------------------
    async def put(self, key: Key, value: Value, *, parents: Iterable[Key] = (),
                  latency_slo: float | None = None) -> None:
        """Store `value` under `key`, replacing (and invalidating) any earlier value.

        `parents` are the keys this value derives from (the first names the prefix block it
        extends): a later write or `invalidate` of any of them removes this object too, even
        when that parent left the cache meanwhile, and even a parent's first write (put a
        chain parent first, as `put_many` does); a parent that derives from `key` is refused
        with `DependencyCycleError`, before anything changes. A `BlockKey` made by
        `block_keys(..., model=...)` is also hung under that model version, for
        `invalidate_model`. A put the object header cannot record and read back (more than
        `MAX_PARENTS` parents, keys and parents' keys that together exceed its `MAX_BODY`, a
        tensor of more than `MAX_DIMS` dimensions: `tierkv.formats`) is refused with
        `LimitExceededError`, also before anything changes. A new value removes everything
        derived from `key` so far, durably, before it is written (and what was put meanwhile
        after, before the call returns; a cancelled put whose value is in place finishes that
        first): a crash never leaves the new value beside what derived from the old one. A
        put during an invalidation that removes one of `parents` ends invalidated (stores
        nothing and removes the key's old value), as if made just before it.

        `latency_slo` (seconds per read, a positive finite real number: `TypeError` for a
        bool or another type, `ValueError` for the rest), if given, places the object in the
        slowest tier whose measured profile reads it that fast at its access frequency
        (`tierkv.scheduler.select_tier`); without it, it enters the first tier that can hold it
        and its LRU++ score decides where it lives from then on. With ``write_back`` the call
        returns once the first tier that can hold the object holds it; with ``write_through`` once a
        persistent tier holds it on media. A full tier makes the put wait for the background
        evictor (at most `engine.space_timeout`). Raises `TierFullError` when no tier can hold it
        in time and `DeviceError` when every tier that could failed; in both cases (and when
        cancelled) the key holds no value, the new one, or (failed before writing) the old one
        without what derived from it, and nothing else is lost."""
        started = perf_counter()
        st = self._st
        raw = encode_key(key)
        meta, payload = encode_value(value, parents=put_parents(key, parents))
        check_header(raw, meta)  # refused now, not when a flush or a demotion writes it down
        if latency_slo is not None:
            latency_slo = slo_seconds(latency_slo)
        with self._span(PUT, raw) as span:
            async with self._call(write=True):
                if latency_slo is not None and st.scheduler.profiles is None:
                    async with self._profiling:
                        if st.scheduler.profiles is None:
                            st.scheduler.profiles = await measure_profiles(st)
                self._writes.check_put(raw, meta)
                if await self._invalidations.put_while_doomed(raw, meta.parents):
                    return
                with st.linking(meta.parents):
                    cascaded = await self._invalidations.before_overwrite(raw)
                    replaced = await self._writes.put(raw, meta, payload, latency_slo)
                # the tier it went into first: its fastest copy as the put let go of the key
                entry = st.index.get(raw)
                placed = entry.locations[0] if entry is not None and entry.locations else None
                # children linked while it was stored count even at a first write
                if replaced or cascaded or st.dag.has_children(raw):
                    await self._invalidations.overwritten(raw, cascaded)
                self._shared.share(raw)
            st.counters.puts += 1
            if placed is not None:
                st.latency.puts[placed].observe(perf_counter() - started)
            if span is not None:
                span.set_attribute("tierkv.bytes", meta.nbytes)
                if placed is not None:
                    span.set_attribute("tierkv.tier", st.names[placed])

    async def put_many(
        self, items: Mapping[KeyT, ValueT] | Iterable[tuple[KeyT, ValueT]]
    ) -> None:
        """`put` of every (key, value) pair, in order.

        `block_keys` chains are linked as they go: a `BlockKey` whose parent block (by the
        digest `block_keys` chained it to, `BlockKey.parent_digest`) came earlier in the same
        call gets that key as its parent, so the scheduler knows the prefix chain (orphans and
        leaves go first) and `prefetch` can follow it, without the caller passing parents.
        Blocks of several prompts may be mixed in one call: each is linked to its own parent
        only (a key put just before it is not taken for its parent), and a `BlockKey` built
        without a `parent_digest` is linked to none; a `BlockKey` equal to one earlier in the
        call (a prefix two prompts share) is put once, the first time. A block whose parent
        block of the call was invalidated meanwhile (or left the cache childless) is not
        stored, nor the blocks below it (`_items.put_chains`). The `TypeError`s,
        `ValueError`s and `LimitExceededError`s of bad items are raised before anything is
        stored."""
        puts = checked_puts(items, self._writes.check_header_room)
        with self._span(PUT_MANY) as span:
            count = await put_chains(puts, lambda k, v, p: self.put(k, v, parents=p),
                                     self._st.index.__contains__, self._st.dag.has_parents,
                                     self.invalidate)
            if span is not None:
                span.set_attribute("tierkv.keys", count)

    async def delete(self, key: Key) -> bool:
        """Remove `key` from every tier, the shared one included (whether this engine held
        it there or not: other engines' local copies stay, `invalidate` is what tells them);
        whether this engine held it."""
        raw = encode_key(key)
        with self._span(DELETE, raw) as span:
            async with self._call(write=True):
                deleted = await self._writes.delete(raw, on_server=True)
            if span is not None:
                span.set_attribute("tierkv.deleted", deleted)
        return deleted

    async def invalidate(self, key: Key) -> int:
        """Remove `key` and every object derived from it, transitively, from every tier;
        returns how many objects were removed. Durable: once it returns, no restart brings any
        of them back, and no `get` returns one of them. Costs what it removes, not the cache.
        Once started it finishes, the fleet told, even if the caller is cancelled meanwhile
        (the caller then gets the `CancelledError` when it has)."""
        raw = encode_key(key)
        with self._span(INVALIDATE, raw) as span:
            async with self._call():
                removed = await self._invalidations.invalidate(raw)
            if span is not None:
                span.set_attribute("tierkv.removed", removed)
        self._st.counters.invalidations += removed
        return removed

    async def invalidate_model(self, model: str) -> int:
        """Remove every block computed with the weights `model` ("name@revision": the `model`
        given to `block_keys`), and everything derived from them; returns how many objects.
        `TypeError` for a `model` that is not a str."""
        with self._span(INVALIDATE_MODEL) as span:
            async with self._call():
                removed = await self._invalidations.below(version_key(model))
            if span is not None:
                span.set_attribute("tierkv.removed", removed)
        self._st.counters.invalidations += removed
        return removed

    async def add_dependency(self, parent: Key, child: Key) -> None:
        """Record that `child` derives from `parent` (both may be stored or not): a later write
        or invalidation of `parent` removes `child`. `DependencyCycleError` if `parent` derives
        from `child`. A stored `child` names `parent` in its header from then on (its persistent
        copies rewritten in place, on media when this returns), so the edge survives a restart;
        `LimitExceededError` if that header would exceed the format's bounds (`MAX_PARENTS`
        parents, a `MAX_BODY` body: `tierkv.formats.header`); both raised before anything
        changes. An edge to a `child` not stored is in the engine's record of such edges, on
        media when this returns; it lasts until a `put(child, parents=...)` sets its parents
        anew, or until nothing derives from `child` (at a restart, or when its last child is
        deleted or put again without it). An edge to a parent an invalidation is removing is
        taken as made before it: `child` is invalidated, no edge kept."""
        async with self._call():
            raw_parent, raw_child = encode_key(parent), encode_key(child)
            if not await self._invalidations.linked_while_doomed(raw_child, (raw_parent,)):
                await self._writes.relink(raw_child, raw_parent)

    async def flush(self) -> None:
        """Barrier: every object put before the call is on persistent media when it returns."""
        with self._span(FLUSH):
            async with self._call():
                await self._flusher.flush()
                await self._shared.save_cursor()

    async def settle(self) -> None:
        """Wait until the background work asked for so far has finished: the evictors have
        acted on every cue (a tier short of space) and the moves and cleanups they and the
        gets started are done. Tests and benchmarks use it to observe a quiet hierarchy."""
        st = self._st
        executor = self._executor
        async with self._call():
            # the moves asked for so far, not those other tasks' reads ask for meanwhile (with
            # a reader that never stops, waiting for an idle executor never returned)
            mark = executor.mark()
            while True:
                await asyncio.sleep(0)  # a turn of the loop for evictors holding a fresh cue
                if executor.open_before(mark):
                    await executor.drain(before=mark)
                elif st.tasks:
                    await st.drain_tasks()
                elif executor.departing:  # what the evictors planned for the cues
                    await executor.drain_departures()
                elif not any(space.cue.is_set() for space in st.spaces  # an evictor's cue
                             if space.watermarks is not None):  # (the log's: no evictor)
                    return

    # -- pins ------------------------------------------------------------------------------------
    def pin(self, key: Key) -> PinContext:
        """``async with kv.pin(key) as handle``: `handle.value` is the L1-resident tensor itself.

        The object is brought into the first (gpu) tier if needed and is neither evicted nor moved
        while any handle holds it. Raises `ObjectNotFound` if the key is not stored, and
        `TierFullError` if the first tier has no room for it (larger than the tier, or full of
        pinned objects).
        """
        self._check_open()
        return PinContext(self._pins, key, self._call)

    # -- introspection ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        """The checks of a call that is not counted as one (`_call`): the engine's own loop
        (`RuntimeError`), not closed."""
        self._one_call.check_loop()
        if self._closed:
            raise EngineClosedError("the engine is closed")

    def _span(self, name: str, raw: bytes | None = None
              ) -> contextlib.AbstractContextManager[Span | None]:
        """The span of a public call (`_tracing`), or a no-op block yielding None."""
        tracing = self._st.tracing
        return contextlib.nullcontext() if tracing is None else tracing.call(name, raw)

