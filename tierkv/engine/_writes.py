"""Puts and deletes: the foreground writes of the engine.

A put holds its key (`KeyGate`): it detaches the key's current entry (gets miss from here on)
and deletes its copies, then writes the new value into the tier the scheduler names — waiting
for space there if the tier is full (backpressure), never evicting itself — and publishes the
new entry when that copy is committed. With ``write_through`` it then writes a copy into the
first persistent tier and waits for that tier's flush, shared with concurrent puts (group
commit). A cancelled or failed put leaves the key with no value or the new one, never another
key's value changed; what it wrote and did not commit is scrubbed (`_keys`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from tierkv.config import WritePolicy
from tierkv.engine._copies import CopyOps
from tierkv.engine._departed import DepartedEdges
from tierkv.engine._index import IndexEntry
from tierkv.engine._keys import Claim
from tierkv.engine._state import EngineState, log
from tierkv.errors import (
    CorruptObjectError,
    DeviceError,
    LimitExceededError,
    TierFullError,
    TierKVError,
    TierUnavailableError,
)
from tierkv.formats.header import MAX_PARENTS, check_header, header_excess
from tierkv.formats.value import ObjectMeta, Payload


class Writes:
    __slots__ = ("_copies", "_departed", "_st", "_write_through")

    def __init__(self, state: EngineState, copies: CopyOps, departed: DepartedEdges) -> None:
        self._st = state
        self._copies = copies
        self._departed = departed
        self._write_through = state.config.engine.write_policy is WritePolicy.WRITE_THROUGH

    async def put(self, key: bytes, meta: ObjectMeta, payload: Payload,
                  latency_slo: float | None = None) -> bool:
        """Store a new value of `key`; whether it replaced one or something derives from `key`
        (an old value that left the cache leaves its children's edges behind): what derives
        from `key` is then the caller's to invalidate. `DependencyCycleError` before anything
        changes if a parent derives from `key`."""
        st = self._st
        async with st.keys.hold(key) as claim:
            st.check_open()
            self.check_header_room(key, meta)
            if self._write_through:
                self._check_durable(key, meta)
            st.index.set_parents(key, meta.parents)
            old = st.index.detach(key, replaced=True)
            rewrites = old is not None or st.dag.has_children(key)
            # write-through: the old value's persistent copies stay on media until the new one
            # is (deleted first, a crash before the new value's flush lost the key's
            # acknowledged value: a free in the pool, a tombstone sealed ahead of the new
            # entry in the log), and go, synced, before the put returns (kept, a crash after
            # the new value left the cache brought the old one back)
            superseded = ([tier for tier in old.locations if st.tiers[tier].persistent
                           and not st.tiers[tier].shared]
                          if old is not None and self._write_through else [])
            try:
                if old is not None:
                    await self._copies.discard(old, claim, spare=superseded)
                entry = st.index.new_entry(key, meta)
                first = st.scheduler.write_tier(entry.nbytes, key, st.now(), latency_slo)
                if first is None:
                    self._check_breakers(entry.nbytes, 0, persistent=False)
                    raise TierFullError(f"no tier can take an object of {entry.nbytes} bytes")
                if not self._write_through:
                    await self._copies.store(entry, payload, first, claim)
                else:
                    # until its flush has returned, a reclaim of the log keeps the new copy
                    st.syncing.add(key)
                    try:
                        placed = await self._copies.store(entry, payload, first, claim)
                        try:
                            await self._make_durable(entry, payload, placed, claim)
                            await self._drop_superseded(entry, superseded, claim)
                        except BaseException:
                            self._abandon(entry, claim)
                            raise
                    finally:
                        st.syncing.discard(key)
            except BaseException:
                # the old value is gone and the new one is not there: what derives from the old
                # one must go too, and no copy of it elsewhere (a shared tier's, whose delete
                # may have failed) may be read again; no await here (a cancelled put too)
                if old is not None and st.lost_overwrite is not None:
                    st.lost_overwrite(key)
                if key not in st.index:
                    # no value: like a key whose object left the cache, it drops the edges from
                    # the parents this put named (kept, each failed or cancelled put of a key
                    # never written again left its edges in the DAG for the engine's life)
                    st.index.unlink(key)
                raise
        return rewrites

    def check_put(self, key: bytes, meta: ObjectMeta) -> None:
        """What `put` raises before anything changes, checked before the put's cascade
        (`Invalidations.before_overwrite`) removes anything: the engine is open, a write-through
        put can be made durable, the parents close no cycle."""
        self._st.check_open()
        self.check_header_room(key, meta)
        if self._write_through:
            self._check_durable(key, meta)
        self._st.dag.check_parents(meta.parents, key)

    def _abandon(self, entry: IndexEntry, claim: Claim) -> None:
        """A write-through put that could not make its value durable leaves no value: the copies
        it committed become orphans that the key's scrub deletes (no await here, so that this
        also holds for a cancelled put)."""
        if self._st.index.get(entry.key) is entry:
            self._st.index.detach(entry.key)
        for tier in entry.locations:
            claim.mark(tier)

    def check_header_room(self, key: bytes, meta: ObjectMeta) -> None:
        """`TierFullError` before anything changes when a persistent tier would take the object
        by its payload (`can_ever_hold`, which counts a header of `SIZED_HEADER` bytes) but not
        with its real header (a long key, many parents): it was placed there, and its write
        refused at every demotion and flush, for good (each `flush()` and `close()` raised)."""
        excess = header_excess(key, meta)
        if not excess:
            return
        for index, tier in enumerate(self._st.tiers):
            if (tier.persistent and not tier.shared and tier.can_ever_hold(meta.nbytes)
                    and not tier.can_ever_hold(meta.nbytes + excess)):
                raise TierFullError(
                    f"tier {self._st.names[index]!r} holds an object of {meta.nbytes} bytes "
                    f"only with a shorter header: this one's key and parents take {excess} "
                    "bytes more than it allows for; shorten the key or store less")

    def _check_durable(self, key: bytes, meta: ObjectMeta) -> None:
        """`TierFullError` before anything changes when the hierarchy has persistent tiers and
        none can ever hold the object (a pool too small, a log's region; its header counted):
        a write-through put acknowledged with the object in volatile memory only would be lost
        by a crash."""
        st = self._st
        excess = header_excess(key, meta)
        nbytes = meta.nbytes + excess
        persistent = [index for index, tier in enumerate(st.tiers) if tier.persistent]
        if persistent and not any(st.tiers[index].can_ever_hold(nbytes) for index in persistent):
            names = ", ".join(repr(st.names[index]) for index in persistent)
            header = f" and a header {excess} bytes over the allowance for one" if excess else ""
            raise TierFullError(f"write_through: no persistent tier ({names}) can hold an "
                                f"object of {meta.nbytes} bytes{header}, so none could make it "
                                "durable")

    async def _drop_superseded(self, entry: IndexEntry, superseded: list[int], claim: Claim
                               ) -> None:
        """Write-through, the new value on media: delete the old value's copies left in the
        `superseded` tiers (those the new value's writes did not replace: a tier's put
        replaces the key's copy), the deletes synced."""
        st = self._st
        stale = [tier for tier in superseded if tier not in entry.locations]
        for tier in stale:
            if await self._copies.delete(entry.key, tier):
                claim.clear(tier)
            elif st.refused_delete is not None:  # the key's scrub retries; a flush records it
                st.refused_delete(entry.key, tier)
        await asyncio.gather(*(st.commits[tier].sync() for tier in stale))

    async def _make_durable(self, entry: IndexEntry, payload: Payload, placed: int,
                            claim: Claim) -> None:
        """Write-through: a persistent tier holds the object, on media, before `put` returns."""
        st = self._st
        if not st.tiers[placed].persistent:
            durable = st.scheduler.durable_tier(entry.nbytes, placed + 1)
            if durable is None:
                self._check_breakers(entry.nbytes, placed + 1, persistent=True)
                if any(tier.persistent for tier in st.tiers):  # above it: it fell through
                    raise TierFullError(f"write_through: an object of {entry.nbytes} bytes "
                                        f"went to {st.names[placed]!r}, below every "
                                        "persistent tier that can hold it")
                return  # the hierarchy has no persistent tier: as durable as it allows
            placed = await self._copies.store(entry, payload, durable, claim)
            if not st.tiers[placed].persistent:  # they failed; it fell through to the shared tier
                raise DeviceError(f"write_through: no persistent tier took an object of "
                                  f"{entry.nbytes} bytes (each failed)")
        failures = st.guards[placed].breaker.failures
        await st.commits[placed].sync()
        if placed not in entry.locations and not entry.detached:
            # a failed write dropped the copy, its error raised to an earlier flush, or a
            # reclaim found no room to keep it (a log full of copies waiting for their
            # flush): the flush that returned here covered none of it; written once more
            placed = await self._copies.store(entry, payload, placed, claim)
            await st.commits[placed].sync()
        if placed not in entry.locations:
            why = (f"write_through: tier {st.names[placed]!r} dropped the copy before it "
                   "reached media, twice")
            if st.guards[placed].breaker.failures > failures:
                raise DeviceError(f"{why} (its writes failed)")
            raise TierFullError(f"{why}: a reclaim found no room to keep it (too small for "
                                "the write-through puts in flight)")

    def _check_breakers(self, nbytes: int, start: int, *, persistent: bool) -> None:
        """`TierUnavailableError` when the tiers from `start` that could hold `nbytes` (the
        persistent ones only: `persistent`) are passed over only because their circuit breakers
        are open: the put failed for their devices, and must not be taken as done (a
        write-through put acknowledged with no persistent copy) or as a full hierarchy."""
        st = self._st
        blocked = [st.names[tier] for tier in range(start, len(st.tiers))
                   if not st.scheduler.usable[tier] and st.tiers[tier].can_ever_hold(nbytes)
                   and (st.tiers[tier].persistent or not persistent)]
        if blocked:
            raise TierUnavailableError(f"no tier can take an object of {nbytes} bytes now: the "
                                       f"circuit breakers of {', '.join(blocked)} are open")

    async def relink(self, key: bytes, parent: bytes) -> None:
        """Record that `key` derives from `parent`, in the DAG and in the parents `key`'s stored
        object names, so that the edge survives a restart: the object's copies in persistent tiers
        and the shared tier (`_carrying`) are rewritten in place with the same bytes and generation
        and the new header, each synced; the other copies keep theirs (what they write down later
        carries the entry's meta). `LimitExceededError` when the new header could not be read back
        and `DependencyCycleError` when `parent` derives from `key`, both before anything changes. A
        cancelled or failed rewrite leaves each copy with the old header or the new one, both the
        same object. Where a rewrite fails (a full pool: the rewrite allocates before it frees; a
        failing device), the carrying copies it did not rewrite are removed, synced (counted and
        logged): kept, a restart would lose the edge, and a new value of `parent` would leave `key`
        readable. The object stays where other copies hold it (a volatile copy writes the new header
        when it moves down), or leaves the cache."""
        st = self._st
        async with st.keys.hold(key) as claim:
            st.check_open()
            entry = st.index.get(key)
            meta = None
            if entry is not None and parent not in entry.meta.parents:
                meta = dataclasses.replace(entry.meta, parents=(*entry.meta.parents, parent))
                # a header that grew past the format's bounds would be written now and freed
                # as corrupt at the next open (or, held in a volatile tier only, fail every
                # flush): the edge is refused instead
                check_header(key, meta)
                self.check_header_room(key, meta)
            elif entry is None and parent not in (parents := st.dag.parents(key)) and len(
                    parents) >= MAX_PARENTS:
                # the bound a stored object's header has: beyond the record of departed
                # edges' own (65,535), every flush and close raised a ValueError for good
                raise LimitExceededError("parents", MAX_PARENTS, len(parents) + 1)
            st.dag.link(parent, key)
            if entry is None:
                st.index.note_departed(key)  # an edge no header holds: recorded on media
                await self._departed.record()
                return
            if meta is None:
                return
            rewritten: set[int] = set()
            try:
                # `key` or `parent` may be held in volatile copies only, `key` with children
                # on media (failing, the copies below are removed as for a failed rewrite)
                await self._departed.ahead_of(key, itself=True)
                await self._rewrite(entry, meta, claim, rewritten)
            except TierKVError as exc:
                st.counters.dag_edges_unpersisted += 1
                log.warning("add_dependency: the edge could not be written into the child's "
                            "header (%s); its stored copies without it are removed", str(exc))
                await self._remove_unlinked(entry, meta, claim, rewritten)

    async def _remove_unlinked(self, entry: IndexEntry, meta: ObjectMeta, claim: Claim,
                               rewritten: set[int]) -> None:
        """After a failed `_rewrite`: remove `entry`'s copies that carry their header past a
        restart (`_carrying`) and lack the new edge (not in `rewritten`), each delete synced;
        the entry takes the new header."""
        st = self._st
        stale = [tier for tier in _carrying(st, entry) if tier not in rewritten]
        leaving: contextlib.AbstractAsyncContextManager[None] = (
            self._departed.leaving(entry.key) if stale and len(stale) == len(entry.locations)
            else contextlib.nullcontext())
        async with leaving:  # its last copies: the edges it keeps go on media first
            for tier in stale:
                if tier in entry.locations and await self._copies.remove(entry, tier, claim):
                    st.counters.drops += 1  # it left the cache
        await asyncio.gather(*(st.commits[tier].sync() for tier in stale))
        if not entry.detached:
            entry.meta = meta

    async def _rewrite(self, entry: IndexEntry, meta: ObjectMeta, claim: Claim,
                       rewritten: set[int]) -> None:
        """`relink`'s rewrite of the carrying copies' headers (`_carrying`), the key held. A rewrite
        into the nvme log appends, and the append may reclaim the region of the entry's earlier copy
        there, which the log reports dropped as it appends: the copy just written is then the
        object's again, or, if the object left the cache meanwhile (that was its last copy), the
        key's scrub deletes it. Until session 23 it stayed on media listed by no entry: a later
        delete found nothing, and a reopen brought the deleted value back. The tiers whose copy has
        the new header, synced, go into `rewritten`."""
        st = self._st
        durable = _carrying(st, entry)
        if durable:
            got = await self._copies.read(entry, entry.locations[0])
            if entry.detached:
                return
            if got is None:
                raise CorruptObjectError("the copy read for the rewrite failed")
            for tier in durable:
                claim.mark(tier)
                await st.guards[tier].write(st.tiers[tier].put, entry.key, meta, got[1])
                if tier in entry.locations or st.index.add_copy(entry, tier, st.now()):
                    claim.clear(tier)
                await st.commits[tier].sync()
                rewritten.add(tier)
        entry.meta = meta

    async def delete(self, key: bytes, *, keep_shared: bool = False,
                     on_server: bool = False) -> bool:
        """Remove `key`'s object; whether this engine held it. `keep_shared`: its shared copy
        is only forgotten. `on_server` (a public delete): the shared tier's object goes too
        even when this engine does not hold it (after a restart it holds nothing there, and
        its next lookup would adopt the deleted value), deleted while the key is held, so no
        lookup adopts it meanwhile; and a key that keeps edges from parents for its children
        has them recorded on media first (`DepartedEdges.leaving`: an invalidation's deletes
        need not, what derives from them goes too)."""
        st = self._st
        shared = st.scheduler.shared
        async with st.keys.hold(key) as claim:
            st.check_open()
            entry = st.index.get(key)
            recording: contextlib.AbstractAsyncContextManager[None] = (
                self._departed.leaving(key)
                if on_server and entry is not None
                and any(st.tiers[tier].persistent for tier in entry.locations)
                else contextlib.nullcontext())
            async with recording:
                entry = st.index.detach(key)
            held_shared = entry is not None and shared in entry.locations
            if entry is not None:
                await self._copies.discard(entry, claim, keep_shared=keep_shared)
            if (on_server and shared is not None and not held_shared
                    and not await self._copies.delete(key, shared)
                    and st.refused_delete is not None):
                st.refused_delete(key, shared)  # deleted again once the server answers
            dropped_record = entry is None and on_server and await self._forget_dropped(key)
            if (entry is not None or dropped_record) and on_server and self._write_through:
                # a public delete (an invalidation syncs once, after its whole cascade)
                await self._sync_deletes()
            return entry is not None

    async def _forget_dropped(self, key: bytes) -> bool:
        """A public delete of a key this engine does not hold: the logs delete a record of it
        that their reclaim dropped a moment ago and a crash would bring back (its region's
        new header not on media yet); whether one did."""
        st = self._st
        found = False
        for tier, device in enumerate(st.tiers):
            if device.reclaims_space and device.persistent and not device.shared:
                try:
                    if await st.guards[tier].delete(device.delete, key):
                        st.commits[tier].note()
                        found = True
                except DeviceError as exc:  # nothing it held is lost; counted
                    st.device_failed(tier, "a delete", exc)
        return found

    async def _sync_deletes(self) -> None:
        """Write-through: a delete that returned is on media. Every persistent tier holding a
        delete not yet synced is synced, not only those the deleted value was in: an older
        value of the key that left the log earlier (expired, its tombstone unsynced) would
        otherwise come back after a crash, once the delete removed the newer one from a tier
        that frees at once (the pool)."""
        st = self._st
        await asyncio.gather(*(st.commits[tier].sync() for tier, device in enumerate(st.tiers)
                               if device.persistent and not device.shared
                               and st.commits[tier].pending))


def _carrying(st: EngineState, entry: IndexEntry) -> list[int]:
    """The tiers whose copy of `entry` keeps its header past a restart: the persistent ones,
    and the shared tier, whose record an engine adopts again after a restart (with its parents
    linked: kept with the old header, a new value of a parent added by `add_dependency` left
    the adopted child readable)."""
    return [tier for tier in entry.locations
            if st.tiers[tier].persistent or st.tiers[tier].shared]

