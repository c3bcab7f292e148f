"""Edges into keys that hold no object, kept across a restart.

In a → b → c, the edge a → b is written in b's header only. When b's object leaves the cache
(evicted from the last tier, deleted) while c is still held, the DAG keeps a → b in memory so
that a write or invalidation of a still reaches c (`Dag.unlink_parents`); a restart lost it, and
then a new value of a left c readable: stale derived data. So every flush records, as one of the
engine's own objects (`_own`, `formats.departed_edges`), the parents of every key that has edges
from parents and holds no object (`Index.departed_keys`: keys that left with children, or got an
edge by `add_dependency` before they were stored). At open, once the recovered headers have
rebuilt the DAG, the recorded edges of each key that something recovered still derives from —
directly or through other recorded keys — are linked again; the rest are forgotten.

What a flush records is what the DAG held when it began, and it is on media when the flush
returns. Between flushes, the places where the engine removes an object's last copy on purpose
record first (`leaving`): a public delete and a move that drops the last copy of a key with
both parents and children write the record holding its edges, and sync it, before the copy
goes; `add_dependency` to a key not stored records its edge before it returns. Otherwise a
`kill -9` before the next flush lost them while the object's removal was already on media (a
pool frees at once). One writer at a time (`GroupCommit` as a single flight): two records
written side by side could leave the older one on media last. Not covered: a key whose last
copy a full log's reclaim drops (the log tells the engine as it drops it) keeps its edges
across a crash only once a flush has recorded them.

Edges held only in volatile copies are recorded before they are needed (`ahead_of`): before a
copy of a key reaches persistent media (a put, a move down, a flush), its ancestors up to
those on media whose edges live only in the headers of volatile copies (a hot prefix block
kept in the first tier while the blocks after it moved down) are recorded, synced, unless a
record on media holds them already; so is the key itself when `add_dependency` gives a key held
in volatile copies only a parent while something derives from it. A `kill -9` lost those
headers while the child came back, linked to nothing above them, and a write or invalidation
of the chain's first block then left it readable. These go into small *delta* records of their
own (``DEPARTED_EDGES_KEY + b"+" + n``), holding only the keys found, which the next full record
covers and then deletes: rewriting the whole record for each (one per chain that moved down
below a hot prefix) wrote a record the size of the first tier's contents per request, and the
churn in the log cost the trace replay 4 % of its hits. A delta no tier takes (counted, logged
once) fails the write it came before with `DeviceError`: a move keeps its source, a put goes
on to the next tier, a flush fails; written anyway, a crash left the copy linked to nothing.
"On media" is what the tier says of its copy (`Tier.on_media`): a copy in the nvme log's
buffer, or in a region written since its last sync, is not, as a `kill -9` loses it (a block
put into the log whose child went into the pool came back without its parent's edge). Copies
in the tier the write goes to count as on media: the log writes its records in the order they
came (but for the two regions it may write at once), and counting them out would cost a
synced record per block of a chain put into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from tierkv.engine._commit import GroupCommit
from tierkv.engine._own import keep_own, own_tiers, read_records
from tierkv.engine._state import EngineState, log
from tierkv.engine.dag import DependencyCycleError
from tierkv.errors import DeviceError, TierKVError
from tierkv.formats.departed_edges import decode_departed_edges, encode_departed_edges
from tierkv.keys import DEPARTED_EDGES_KEY

Edges = dict[bytes, tuple[bytes, ...]]
#: the names of the delta records (`ahead_of`), each followed by its number
_DELTA = DEPARTED_EDGES_KEY + b"+"
#: delta records on media at most: the next one is followed by a full record
MAX_DELTAS = 64


class DepartedEdges:
    __slots__ = ("_deltas", "_failing", "_leaving", "_next_delta", "_one", "_recorded", "_st",
                 "_volatile", "lost_at_open")

    def __init__(self, state: EngineState) -> None:
        self._st = state
        #: what the newest record on media holds
        self._recorded: Edges = {}
        state.record_dropped[DEPARTED_EDGES_KEY] = self._unrecorded
        #: keys whose last copy is about to go (`leaving`): recorded while still stored
        self._leaving: set[bytes] = set()
        #: stored keys whose edges only volatile copies hold, below which something was
        #: written to persistent media (`ahead_of`): recorded until a copy of theirs is too
        self._volatile: set[bytes] = set()
        #: delta records on media that the next full record covers (then deletes)
        self._deltas: set[bytes] = set()
        self._next_delta = 0
        #: whether the last delta failed (logged once until one is written)
        self._failing = False
        self._one = GroupCommit(self._write)
        #: whether the open found the record on media with no copy readable (`recover`)
        self.lost_at_open = False

    def current(self) -> Edges:
        """The edges into keys that hold no object now, or are about to hold none."""
        dag = self._st.dag
        keys = self._st.index.departed_keys()
        if self._leaving:
            keys = keys | {key for key in self._leaving if dag.has_parents(key)}
        if self._volatile:
            self._volatile = {key for key in self._volatile if self._held_volatile(key)}
            keys = keys | self._volatile
        return {key: tuple(sorted(dag.parents(key))) for key in keys}

    def _held_volatile(self, key: bytes, into: int = -1) -> bool:
        """Whether `key` is stored, has parents, and no copy of it is on media for sure (a
        copy in the nvme log's buffer is not, nor one written since its last sync: a `kill -9`
        loses it; the shared tier's and `into`'s count, see `ahead_of`)."""
        st = self._st
        entry = st.index.get(key)
        if entry is None or not st.dag.has_parents(key):
            return False
        shared = st.scheduler.shared
        return not any(tier in (shared, into) or st.tiers[tier].on_media(key)
                       for tier in entry.locations)

    async def ahead_of(self, key: bytes, *, itself: bool = False, into: int = -1) -> bool:
        """Before a copy of `key` is written to a persistent tier (`into`, if one): record
        the edges of its ancestors that no copy on media holds (`itself`: of `key` too, if
        something derives from it), in a delta record, synced, unless a record on media holds
        them (see the module); whether it wrote one (awaited). Copies in `into` itself count as
        on media: the log writes its records in order (but for the two regions it writes at
        once), and would otherwise cost a record per block of a chain put into it. Costs the
        parents of `key` when they are on media or recorded."""
        st = self._st
        dag = st.dag
        found = self._unrecorded_ancestors(key, itself=itself and dag.has_children(key),
                                           into=into)
        if not found or not own_tiers(st):
            return False
        self._volatile.update(found)
        edges = {node: tuple(sorted(dag.parents(node))) for node in found}
        name = _DELTA + b"%d" % self._next_delta
        self._next_delta += 1
        try:
            # one copy, in the first tier that takes it: the next full record keeps two
            written = await keep_own(st, name, encode_departed_edges(edges), own_tiers(st),
                                     copies=1)
            for tier in written:
                await st.commits[tier].sync()
        except TierKVError as exc:
            # the copy below them is not written: on media, a crash would leave it linked to
            # nothing above them (a move keeps its source, a put goes on to other tiers)
            st.counters.departed_edges_unrecorded += 1
            if not self._failing:
                log.warning("the edges of %d keys held in volatile copies only could not be "
                            "recorded (%s): what derives from them is not written to "
                            "persistent media until they are", len(edges), str(exc))
            self._failing = True
            raise DeviceError("the edges of keys held in volatile copies only could not be "
                              f"recorded ahead of a copy derived from them: {exc}") from exc
        self._failing = False
        self._deltas.add(name)
        st.record_dropped[name] = self._unrecorded
        self._recorded.update(edges)
        if len(self._deltas) >= MAX_DELTAS:
            await self.record()  # one full record in their place (an engine that never
            # flushed kept every delta: thousands of small objects in the pool)
        return True

    def _unrecorded_ancestors(self, key: bytes, *, itself: bool, into: int) -> list[bytes]:
        """`key`'s ancestors (and `key`, `itself`) held in volatile copies only, up to those
        on media, recorded or without parents; the walk stops at a recorded one (its own were
        recorded with it)."""
        dag = self._st.dag
        found: list[bytes] = []
        seen: set[bytes] = set() if itself else {key}
        # its parents whatever `key` is: one on media still gets a parent held in volatile
        # copies only from `add_dependency`
        pending = [*dag.parents(key), key] if itself else list(dag.parents(key))
        while pending:
            node = pending.pop()
            if node in seen or not self._held_volatile(node, into):
                continue
            seen.add(node)
            parents = dag.parents(node)
            if self._recorded.get(node) != tuple(sorted(parents)):
                found.append(node)
                pending.extend(parents)
        return found

    async def record(self) -> None:
        """Write the record, and sync it, if the edges changed since the last one was written
        (a flush calls this, and `leaving`). One that no tier takes (full, failing) is logged
        and counted, and the next flush tries again: the flush itself, which made every object
        durable, does not fail for it, nor does the delete or move that asked."""
        await self._one.sync()

    @contextlib.asynccontextmanager
    async def leaving(self, key: bytes) -> AsyncIterator[None]:
        """Around the removal of `key`'s last copy, the key held: when it has parents and
        children and no record on media holds its edges yet, write one that does first, so
        that the removal never reaches media before the edges do."""
        dag = self._st.dag
        if (not dag.has_children(key) or not dag.has_parents(key)
                or self._recorded.get(key) == tuple(sorted(dag.parents(key)))
                or not own_tiers(self._st)):
            yield
            return
        self._leaving.add(key)
        try:
            await self.record()
            yield
        finally:
            self._leaving.discard(key)

    def _unrecorded(self, _tier: int) -> None:
        """A tier dropped a copy of the record: the next flush writes it again."""
        self._recorded = {}

    async def _write(self) -> None:
        st = self._st
        edges = self.current()
        covered = set(self._deltas)  # on media now: this record covers them
        if edges == self._recorded and not covered:
            return
        try:
            written = await keep_own(st, DEPARTED_EDGES_KEY,
                                     encode_departed_edges(edges) if edges else None,
                                     own_tiers(st) if edges else ())
            for tier in written:
                await st.commits[tier].sync()
        except TierKVError as exc:
            st.counters.departed_edges_unrecorded += 1
            log.warning("the edges into %d keys whose objects left could not be recorded "
                        "(%s): after a restart, a write or invalidation of their parents may "
                        "not reach what derives from them", len(edges), str(exc))
            return
        self._recorded = edges
        await self._delete_deltas(covered)

    async def _delete_deltas(self, names: set[bytes]) -> None:
        """The full record on media covers these deltas: delete them (one whose delete fails
        stays, and is read again at the next open: it only repeats edges). The persistent
        tiers are synced first: a key the full record left out as on media may have only a
        copy the log has not written down yet."""
        st = self._st
        if not names:
            return
        for index, tier in enumerate(st.tiers):
            if tier.persistent and not tier.shared:
                try:
                    await st.commits[index].sync()
                except TierKVError:
                    return  # kept: the next full record deletes them
        for name in names:
            try:
                await keep_own(st, name, None)
            except TierKVError:
                continue
            if name not in st.own:
                self._deltas.discard(name)
                st.record_dropped.pop(name, None)

    async def recover(self) -> None:
        """At open, after the tiers' objects are indexed: link the recorded edges again where
        something still derives from the key."""
        st = self._st
        found: dict[bytes, set[bytes]] = {}
        records = await read_records(
            st, DEPARTED_EDGES_KEY, decode_departed_edges,
            "the record of edges into departed keys is unreadable (what derives from keys "
            "that left is dropped)")
        damaged = {name for tier in st.tiers for name in tier.damaged_at_open()}
        # every copy damaged (or a delta's one): `cut_off_by_damage` drops what derives from
        # keys that left
        self.lost_at_open = ((not records and (bool(st.own.get(DEPARTED_EDGES_KEY))
                                              or DEPARTED_EDGES_KEY in damaged))
                             or any(name.startswith(_DELTA) for name in damaged))
        for name in [name for name in st.own if name.startswith(_DELTA)]:
            delta = await read_records(st, name, decode_departed_edges,
                                       "a delta of the record of departed edges is unreadable")
            self.lost_at_open = self.lost_at_open or not delta
            records += delta
            self._deltas.add(name)
            st.record_dropped[name] = self._unrecorded
            number = name[len(_DELTA):]
            if number.isdigit():
                self._next_delta = max(self._next_delta, int(number) + 1)
        for edges in records:
            for key, listed in edges.items():  # two copies of differing age: both hold
                found.setdefault(key, set()).update(listed)
        self._recorded = {key: tuple(sorted(parents)) for key, parents in found.items()}
        # the keys something recovered derives from; a recorded parent gains a child as a key
        # is linked to it, and joins them (each key once: a chain of departed keys is linear)
        ready = [key for key in found if st.dag.has_children(key)]
        while ready:
            key = ready.pop()
            recorded = found.pop(key, None)
            if recorded is None or key in st.index:
                continue  # linked already, or stored again: its header names its parents
            for parent in sorted(recorded):
                try:
                    st.dag.link(parent, key)
                except DependencyCycleError as exc:
                    st.counters.dag_edges_refused += 1
                    log.warning("recovery: %s; that departed edge is not restored", str(exc))
                    continue
                if parent in found:
                    ready.append(parent)
            st.index.note_departed(key)
