"""The NVMe tier's DRAM index: key → (region, offset, length, generation), ~90 bytes an entry.

No Python object per entry: key bytes live back to back in one `bytearray` *arena*, and every
number about an entry lives in `array.array` columns indexed by a *slot* number (44 bytes a
slot). An open-addressing hash table (linear probing, power-of-two size, at most 70 % full
counting tombstones) maps ``xxh3_64(key)`` to a slot; each slot keeps 32 bits of its key's hash
as a *tag*, so a probe compares key bytes only when the tag matches. `array.array` rather than
numpy because indexing it returns plain ints several times faster, which matters on every `get`;
`keys_in_region` still scans the region column vectorised through a zero-copy numpy view.

What is not a number (value kind, dtype, shape, parents) is interned: entries sharing it share
one tuple (plain byte values without parents all share id 0). Offsets and lengths are stored in
units of the log's granularity (both must be multiples of it), ``nbytes`` as the entry's slack
(length - nbytes), hits saturate at 65535. Deleted entries leave a tombstone in the table
(cleared by the next rebuild) and their key bytes in the arena (compacted once dead bytes
exceed the live ones). Memory with 1 M 33-byte keys, by tracemalloc
(`tierkv.bench.nvme.index_bytes_per_entry`): about 90 bytes an entry - 44 of columns, 33 of
key, 8 of table, plus the arrays' growth slack.

Sizes for the checkpoint reservation (`_reserve`), kept as entries come and go, at no cost per
lookup: `key_bytes` (the live keys' bytes) and `meta_bytes` (the sum over live entries of a
weight of their interned metadata, given by the `weigh` callable; 0 without one), so the
checkpoint's size is bounded without walking the index.

`initial_table` (a power of two) and `compact_min` (dead arena bytes tolerated before a
compaction is considered) exist so tests can force rebuilds and compactions on small data.

Not thread-safe; the tier uses it from the event loop thread only. Invalid input (a key of
0 or more than 65536 bytes, ``nbytes`` larger than ``length``) raises `ValueError`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from tierkv._untracked import untrack
from tierkv.formats.value import ObjectMeta, ValueKind

_Shape = tuple[ValueKind, str, tuple[int, ...], tuple[bytes, ...]]
_PLAIN: _Shape = (ValueKind.BYTES, "", (), ())
_EMPTY = -1
_DELETED = -2
_INITIAL_TABLE = 1024
_MAX_FILL = 0.7
_MAX_KEY = 1 << 16
_MAX_HITS = 0xFFFF
_COMPACT_MIN = 1 << 20
_hash = xxhash.xxh3_64_intdigest

#: weighs an entry's interned metadata (dtype, shape, parents) for `NvmeIndex.meta_bytes`
Weigh = Callable[[str, tuple[int, ...], tuple[bytes, ...]], int]


def _weightless(_dtype: str, _shape: tuple[int, ...], _parents: tuple[bytes, ...]) -> int:
    return 0


@dataclass(frozen=True, slots=True)
class Location:
    """Where one entry lives: region index, byte offset in the region, packed entry length."""

    region: int
    offset: int
    length: int
    generation: int
    hits: int


class NvmeIndex:
    """See the module docstring."""

    def __init__(self, unit: int, *, initial_table: int = _INITIAL_TABLE,
                 compact_min: int = _COMPACT_MIN, weigh: Weigh = _weightless) -> None:
        if initial_table < 2 or initial_table & (initial_table - 1):
            raise ValueError("initial_table must be a power of two")
        self._unit = unit
        self._initial = initial_table
        self._compact_min = compact_min
        self._arena = bytearray()
        self._dead = 0  # arena bytes of removed keys
        self._table = array("i", [_EMPTY]) * initial_table
        self._mask = initial_table - 1
        self._fill = 0  # table cells that are not empty (live + deleted)
        self._live = 0
        self._free = array("i")  # slots of removed entries, reused first
        # per-slot columns
        self._key_at = array("Q")
        self._key_len = array("H")  # length - 1
        self._tag = array("I")
        self._region = array("i")  # -1: a free slot
        self._offset = array("I")
        self._length = array("I")
        self._hits = array("H")
        self._shape_id = array("I")
        self._generation = array("Q")
        self._slack = array("I")
        self._shapes: list[_Shape] = [_PLAIN]
        self._shape_refs: list[int] = [1]
        self._shape_ids: dict[_Shape, int] = {_PLAIN: 0}
        self._free_shapes: list[int] = []
        self._weigh = weigh
        self._shape_weights: list[int] = [weigh(*_PLAIN[1:])]
        self._key_bytes = 0
        self._meta_bytes = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: bytes) -> bool:
        return self._find(key)[0] >= 0

    def keys(self) -> Iterator[bytes]:
        """A snapshot of the keys (safe to mutate the index while iterating it)."""
        return iter([self._key(slot) for slot in self._live_slots()])

    @property
    def key_bytes(self) -> int:
        """Bytes of the live keys, summed."""
        return self._key_bytes

    @property
    def meta_bytes(self) -> int:
        """The `weigh` of every live entry's metadata, summed."""
        return self._meta_bytes

    def weight(self, meta: ObjectMeta) -> int:
        """What an entry of `meta` would add to `meta_bytes`."""
        found = self._shape_ids.get((meta.kind, meta.dtype, meta.shape, meta.parents))
        if found is not None:
            return self._shape_weights[found]
        return self._weigh(meta.dtype, meta.shape, meta.parents)

    # -- mutation --------------------------------------------------------------------------------
    def put(self, key: bytes, *, region: int, offset: int, length: int, meta: ObjectMeta,
            hits: int = 0) -> Location | None:
        """Point `key` at a new entry; returns where the replaced entry was, if any."""
        if not 0 < len(key) <= _MAX_KEY:
            raise ValueError(f"index keys are 1..{_MAX_KEY} bytes")
        if offset % self._unit or length % self._unit:
            raise ValueError("entry offset and length must be multiples of the unit")
        if not 0 <= length - meta.nbytes < 1 << 32:
            raise ValueError("nbytes exceeds the entry length")
        slot, cell, tag = self._find(key)
        if slot >= 0:
            old: Location | None = self._location(slot)
            self._release_shape(self._shape_id[slot])
        else:
            old = None
            if self._fill + 1 > _MAX_FILL * len(self._table):
                self._rebuild(self._live + 1)
                slot, cell, tag = self._find(key)
            slot = self._new_slot(key, tag)
            if self._table[cell] == _EMPTY:
                self._fill += 1
            self._table[cell] = slot
            self._live += 1
        self._region[slot] = region
        self._offset[slot] = offset // self._unit
        self._length[slot] = length // self._unit
        self._hits[slot] = min(hits, _MAX_HITS)
        self._generation[slot] = meta.generation
        self._slack[slot] = length - meta.nbytes
        shape_id = self._intern((meta.kind, meta.dtype, meta.shape, meta.parents))
        self._shape_id[slot] = shape_id
        self._meta_bytes += self._shape_weights[shape_id]
        return old

    def remove(self, key: bytes) -> Location | None:
        slot, cell, _tag = self._find(key)
        if slot < 0:
            return None
        location = self._location(slot)
        self._release_shape(self._shape_id[slot])
        self._table[cell] = _DELETED
        self._region[slot] = -1
        self._free.append(slot)
        self._live -= 1
        self._dead += self._key_len[slot] + 1
        self._key_bytes -= self._key_len[slot] + 1
        if self._dead > self._compact_min and self._dead > len(self._arena) - self._dead:
            self._compact()
        return location

    def touch(self, key: bytes) -> None:
        slot = self._find(key)[0]
        if slot >= 0 and self._hits[slot] < _MAX_HITS:
            self._hits[slot] += 1

    # -- queries ---------------------------------------------------------------------------------
    def get(self, key: bytes) -> Location | None:
        slot = self._find(key)[0]
        return None if slot < 0 else self._location(slot)

    def meta(self, key: bytes) -> ObjectMeta | None:
        slot = self._find(key)[0]
        if slot < 0:
            return None
        kind, dtype, shape, parents = self._shapes[self._shape_id[slot]]
        nbytes = self._length[slot] * self._unit - self._slack[slot]
        return ObjectMeta(kind, dtype, shape, nbytes, self._generation[slot], parents)

    def keys_in_region(self, region: int) -> list[bytes]:
        """Keys whose entry lives in `region` (a vectorised scan of the region column)."""
        column = np.frombuffer(self._region, dtype=np.int32)
        slots = np.flatnonzero(column == region).tolist()
        del column  # the view pins the array's buffer: it could not grow while alive
        return [self._key(slot) for slot in slots]

    def memory_bytes(self) -> int:
        """Bytes held by the index's containers (arena, table, columns, free list, interned
        shapes) as `sys.getsizeof` reports them; with no per-entry Python objects this is all
        the index holds, so it agrees with a tracemalloc measurement at a fraction of its cost."""
        containers: list[object] = [
            self._arena, self._table, self._free, self._key_at, self._key_len, self._tag,
            self._region, self._offset, self._length, self._hits, self._shape_id,
            self._generation, self._slack, self._shapes, self._shape_refs, self._shape_ids,
            self._free_shapes, self._shape_weights,
        ]
        return sum(sys.getsizeof(c) for c in containers) + sum(
            sys.getsizeof(shape) for shape in self._shapes
        )

    # -- internals -------------------------------------------------------------------------------
    def _find(self, key: bytes) -> tuple[int, int, int]:
        """(slot or -1, the table cell holding it or where to insert it, the key's tag)."""
        digest = _hash(key)
        tag = digest >> 32
        mask = self._mask
        cell = digest & mask
        table, tags = self._table, self._tag
        insert_at = -1
        while True:
            slot = table[cell]
            if slot == _EMPTY:
                return -1, (cell if insert_at < 0 else insert_at), tag
            if slot == _DELETED:
                if insert_at < 0:
                    insert_at = cell
            elif tags[slot] == tag and self._key(slot) == key:
                return slot, cell, tag
            cell = (cell + 1) & mask

    def _key(self, slot: int) -> bytes:
        start = self._key_at[slot]
        return bytes(self._arena[start : start + self._key_len[slot] + 1])

    def _location(self, slot: int) -> Location:
        unit = self._unit
        return Location(self._region[slot], self._offset[slot] * unit,
                        self._length[slot] * unit, self._generation[slot], self._hits[slot])

    def _live_slots(self) -> list[int]:
        column = np.frombuffer(self._region, dtype=np.int32)
        slots: list[int] = np.flatnonzero(column >= 0).tolist()
        return slots

    def _new_slot(self, key: bytes, tag: int) -> int:
        at = len(self._arena)
        self._arena += key
        self._key_bytes += len(key)
        if self._free:
            slot = self._free.pop()
            self._key_at[slot] = at
            self._key_len[slot] = len(key) - 1
            self._tag[slot] = tag
            return slot
        slot = len(self._region)
        self._key_at.append(at)
        self._key_len.append(len(key) - 1)
        self._tag.append(tag)
        for column in (self._region, self._offset, self._length, self._hits, self._shape_id,
                       self._generation, self._slack):
            column.append(0)
        return slot

    def _rebuild(self, entries: int) -> None:
        """A fresh table sized for `entries` at most half full, without tombstones."""
        size = self._initial
        while entries > size // 2:
            size *= 2
        table = array("i", [_EMPTY]) * size
        mask = size - 1
        arena, key_at, key_len = self._arena, self._key_at, self._key_len
        for slot in self._live_slots():
            start = key_at[slot]
            cell = _hash(arena[start : start + key_len[slot] + 1]) & mask
            while table[cell] != _EMPTY:
                cell = (cell + 1) & mask
            table[cell] = slot
        self._table, self._mask, self._fill = table, mask, self._live

    def _compact(self) -> None:
        """Rewrite the arena with live keys only (free slots keep no key bytes)."""
        arena = bytearray()
        old, key_at, key_len = self._arena, self._key_at, self._key_len
        for slot in self._live_slots():
            start = key_at[slot]
            key_at[slot] = len(arena)
            arena += old[start : start + key_len[slot] + 1]
        self._arena, self._dead = arena, 0

    def _intern(self, shape: _Shape) -> int:
        found = self._shape_ids.get(shape)
        if found is not None:
            self._shape_refs[found] += 1
            return found
        weight = self._weigh(*shape[1:])
        # atoms and an enum member (which keep a tuple tracked): no cycle passes through it,
        # and a block chain interns one per entry (`tierkv._untracked`)
        untrack(shape)
        if self._free_shapes:
            new = self._free_shapes.pop()
            self._shapes[new] = shape
            self._shape_refs[new] = 1
            self._shape_weights[new] = weight
        else:
            new = len(self._shapes)
            self._shapes.append(shape)
            self._shape_refs.append(1)
            self._shape_weights.append(weight)
        self._shape_ids[shape] = new
        return new

    def _release_shape(self, shape_id: int) -> None:
        self._meta_bytes -= self._shape_weights[shape_id]
        if shape_id == 0:
            return
        self._shape_refs[shape_id] -= 1
        if self._shape_refs[shape_id] == 0:
            del self._shape_ids[self._shapes[shape_id]]
            self._shapes[shape_id] = _PLAIN
            self._free_shapes.append(shape_id)
