"""The engine's index: for every key, its object's meta and which tiers hold a valid copy.

`Index` is the one owner of "where is key K". Every change of an entry's copies goes through it,
so the scheduler's per-tier policies and the set of objects `flush` must persist (those without
a persistent copy) never disagree with the entries. All of it runs on the loop, synchronously:
an index change is a single step that no other task can interleave with.

An entry is *published* once its first copy is committed (a get finds it from then on) and
*detached* when it leaves the index (deleted, overwritten, invalidated, or its last copy lost);
a detached entry is never published again, which is how an operation that ran while its entry
was replaced learns that its result is void.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from tierkv._untracked import untrack
from tierkv.engine.dag import Dag
from tierkv.formats.value import ObjectMeta
from tierkv.keys import is_block_key
from tierkv.scheduler import Scheduler

#: `Index.note_departed` prunes its set of departed keys beyond this size (or twice what was
#: left at the last pruning)
_DEPARTED_MIN = 1024


@dataclass(slots=True, eq=False)
class IndexEntry:
    """One stored object: its key, meta (with its generation) and the tiers holding a copy,
    fastest first. `moving`: a background plan for it is planned or running (so the scheduler
    is not asked to move it twice)."""

    key: bytes
    meta: ObjectMeta
    locations: list[int] = field(default_factory=list)
    moving: bool = False
    published: bool = False
    detached: bool = False

    def __post_init__(self) -> None:
        # atoms, a meta and a list of ints: no cycle can pass through them (`tierkv._untracked`)
        untrack(self)
        untrack(self.locations)

    @property
    def generation(self) -> int:
        return self.meta.generation

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes


class Index:
    """Keys → entries, with the policies and the unflushed set kept in step (see the module)."""

    def __init__(self, persistent: Sequence[bool], scheduler: Scheduler, dag: Dag,
                 shared: int | None = None, *, in_use: Callable[[bytes], bool] | None = None
                 ) -> None:
        self._entries: dict[bytes, IndexEntry] = {}
        #: whether a key has an object or is held by an operation (`Dag.unlink_parents`)
        self._in_use = self.__contains__ if in_use is None else in_use
        #: published entries no persistent tier holds a copy of: what `flush` must write down
        #: (not those held only by the shared tier: objects adopted from the fleet)
        self._volatile: dict[bytes, IndexEntry] = {}
        self._persistent = tuple(persistent)
        self._shared = shared
        self._scheduler = scheduler
        #: the dependency DAG: an object that leaves the cache drops its edges from its parents
        self._dag = dag
        self._generation = 0
        #: keys that may hold no object and still have edges from parents (`unlink`): what
        #: `engine._departed` records at each flush (`departed_keys`)
        self._departed: set[bytes] = set()
        #: its size that makes `unlink` prune it: an engine that never flushes must not keep
        #: every key that ever left with children
        self._departed_bound = _DEPARTED_MIN

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> IndexEntry | None:
        return self._entries.get(key)

    def key_list(self) -> list[bytes]:
        """A snapshot of the keys indexed."""
        return list(self._entries)

    def volatile(self) -> list[IndexEntry]:
        """A snapshot of the published entries that no persistent tier holds."""
        return list(self._volatile.values())

    @property
    def unflushed(self) -> int:
        return len(self._volatile)

    # -- lifecycle of entries ----------------------------------------------------------------
    def new_entry(self, key: bytes, meta: ObjectMeta) -> IndexEntry:
        """An unpublished entry for a new value of `key`, with the next generation."""
        self._generation += 1
        return IndexEntry(key, meta.with_generation(self._generation))

    @property
    def issued(self) -> int:
        """The largest generation numbered so far (recovered, or given to a new entry)."""
        return self._generation

    def adopt_generation(self, generation: int) -> None:
        """Recovery found `generation` on media: later puts number above it."""
        self._generation = max(self._generation, generation)

    def detach(self, key: bytes, *, replaced: bool = False) -> IndexEntry | None:
        """Remove `key`'s entry from the index; its copies (`locations`) are now the caller's
        to delete. Returns the entry, or ``None``. Unless a new value `replaced` it, the key's
        edges from its parents go too (its edges to its children stay while they are held)."""
        entry = self._entries.pop(key, None)
        if not replaced:
            self.unlink(key)
        if entry is None:
            return None
        entry.detached = True
        self._volatile.pop(key, None)
        for tier in entry.locations:
            self._scheduler.removed(tier, key)
        return entry

    def set_parents(self, key: bytes, parents: Iterable[bytes]) -> None:
        """`Dag.set_parents` of a new value of `key`, releasing parents left with nothing."""
        self._dag.set_parents(key, parents, self._in_use)

    def unlink(self, key: bytes) -> None:
        """`key` holds no object (it left, or its put failed): drop its edges from its parents
        unless something still derives from it (`Dag.unlink_parents`); one that keeps them is
        noted (`note_departed`), so that they outlive a restart."""
        self._dag.unlink_parents(key, self._in_use)
        if self._dag.has_parents(key):
            self.note_departed(key)

    def note_departed(self, key: bytes) -> None:
        """`key` may hold no object and have edges from parents (`departed_keys`)."""
        self._departed.add(key)
        if len(self._departed) > self._departed_bound:
            self.departed_keys()  # amortised: the bound doubles what is left

    def departed_keys(self) -> AbstractSet[bytes]:
        """The keys that hold no object and have edges from parents now (those that left
        with children, edges `add_dependency` made to keys not stored); the ones noted that
        no longer do are forgotten."""
        dag = self._dag
        self._departed = {key for key in self._departed
                          if key not in self._entries and dag.has_parents(key)}
        self._departed_bound = max(_DEPARTED_MIN, 2 * len(self._departed))
        return self._departed

    # -- copies ------------------------------------------------------------------------------
    def add_copy(self, entry: IndexEntry, tier: int, now: float) -> bool:
        """Record that `tier` now holds a copy of `entry`, publishing it if it was not yet.
        False (and nothing recorded) if the entry was detached meanwhile."""
        if entry.detached:
            return False
        if tier not in entry.locations:
            entry.locations.append(tier)
            entry.locations.sort()
        # the scheduler's prefix chains: a block and the block before it (the first parent), not
        # model-version nodes or other dependencies (a child of a document that is not cached
        # is not worthless the way a block after a missing block is)
        parents = entry.meta.parents
        if not (parents and is_block_key(entry.key) and is_block_key(parents[0])):
            parents = ()
        self._scheduler.admitted(tier, entry.key, now, parents)
        if not entry.published:
            entry.published = True
            previous = self._entries.get(entry.key)
            if previous is not None and previous is not entry:
                raise AssertionError("an entry was published over another one")
            self._entries[entry.key] = entry
        self._track(entry)
        return True

    def remove_copy(self, entry: IndexEntry, tier: int) -> bool:
        """Record that `tier` no longer holds `entry`'s copy. True when that was its last copy:
        the entry is then detached (the object has left the cache)."""
        if tier not in entry.locations:
            return False
        entry.locations.remove(tier)
        if entry.detached:  # its policy records went with it (a newer entry may have its own)
            return False
        self._scheduler.removed(tier, entry.key)
        if not entry.locations:
            self.detach(entry.key)
            return True
        self._track(entry)
        return False

    def _track(self, entry: IndexEntry) -> None:
        persistent = self._persistent
        if entry.locations == [self._shared]:
            self._volatile.pop(entry.key, None)
            return
        for tier in entry.locations:
            if persistent[tier]:
                self._volatile.pop(entry.key, None)
                return
        self._volatile[entry.key] = entry
