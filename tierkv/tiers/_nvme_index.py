"""The NVMe tier's DRAM index: key → (region, offset, length, generation), kept compact.

One Python dict maps each key to a slot number; everything else about the entry lives in numpy
columns indexed by slot (36 bytes a slot), so an entry costs the dict slot, the key object, the
slot int and the columns — no per-entry Python record. What is not a number (value kind, dtype,
shape, parents) is interned: entries that share it share one tuple (plain byte values without
parents all share id 0). Offsets and lengths are stored in units of the tier's alignment.

Not thread-safe; the tier uses it from the event loop thread only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from tierkv.formats.value import ObjectMeta, ValueKind

_Shape = tuple[ValueKind, str, tuple[int, ...], tuple[bytes, ...]]
_PLAIN: _Shape = (ValueKind.BYTES, "", (), ())
_INITIAL = 1024
G = TypeVar("G", bound=np.generic)


@dataclass(frozen=True, slots=True)
class Location:
    """Where one entry lives: region index, byte offset in the region, aligned entry length."""

    region: int
    offset: int
    length: int
    generation: int
    hits: int


class NvmeIndex:
    """See the module docstring."""

    def __init__(self, alignment: int) -> None:
        self._unit = alignment
        self._slot_of: dict[bytes, int] = {}
        self._keys: list[bytes | None] = []
        self._free: list[int] = []
        self._region: npt.NDArray[np.int32] = np.full(_INITIAL, -1, dtype=np.int32)
        self._offset: npt.NDArray[np.uint32] = np.zeros(_INITIAL, dtype=np.uint32)
        self._length: npt.NDArray[np.uint32] = np.zeros(_INITIAL, dtype=np.uint32)
        self._hits: npt.NDArray[np.uint32] = np.zeros(_INITIAL, dtype=np.uint32)
        self._shape_id: npt.NDArray[np.uint32] = np.zeros(_INITIAL, dtype=np.uint32)
        self._generation: npt.NDArray[np.uint64] = np.zeros(_INITIAL, dtype=np.uint64)
        self._nbytes: npt.NDArray[np.uint64] = np.zeros(_INITIAL, dtype=np.uint64)
        self._shapes: list[_Shape] = [_PLAIN]
        self._shape_refs: list[int] = [1]
        self._shape_ids: dict[_Shape, int] = {_PLAIN: 0}
        self._free_shapes: list[int] = []

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._slot_of))

    # -- mutation --------------------------------------------------------------------------------
    def put(self, key: bytes, *, region: int, offset: int, length: int, meta: ObjectMeta,
            hits: int = 0) -> Location | None:
        """Point `key` at a new entry; returns where the replaced entry was, if any."""
        old = self.remove(key)
        slot = self._free.pop() if self._free else self._grow()
        self._slot_of[key] = slot
        self._keys[slot] = key
        self._region[slot] = region
        self._offset[slot] = offset // self._unit
        self._length[slot] = length // self._unit
        self._hits[slot] = min(hits, 0xFFFFFFFF)
        self._generation[slot] = meta.generation
        self._nbytes[slot] = meta.nbytes
        self._shape_id[slot] = self._intern((meta.kind, meta.dtype, meta.shape, meta.parents))
        return old

    def remove(self, key: bytes) -> Location | None:
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return None
        location = self._location(slot)
        self._release_shape(int(self._shape_id[slot]))
        self._keys[slot] = None
        self._region[slot] = -1
        self._free.append(slot)
        return location

    def touch(self, key: bytes) -> None:
        slot = self._slot_of.get(key)
        if slot is not None and self._hits[slot] < 0xFFFFFFFF:
            self._hits[slot] += 1

    # -- queries ---------------------------------------------------------------------------------
    def get(self, key: bytes) -> Location | None:
        slot = self._slot_of.get(key)
        return None if slot is None else self._location(slot)

    def meta(self, key: bytes) -> ObjectMeta | None:
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        kind, dtype, shape, parents = self._shapes[int(self._shape_id[slot])]
        return ObjectMeta(kind, dtype, shape, int(self._nbytes[slot]),
                          int(self._generation[slot]), parents)

    def keys_in_region(self, region: int) -> list[bytes]:
        """Keys whose entry lives in `region` (a vectorised scan of the region column)."""
        slots = np.flatnonzero(self._region[: len(self._keys)] == region)
        return [key for key in (self._keys[int(s)] for s in slots) if key is not None]

    def column_bytes(self) -> int:
        """Bytes held by the numpy columns and the slot list (for the memory benchmark)."""
        columns = (self._region, self._offset, self._length, self._hits, self._shape_id,
                   self._generation, self._nbytes)
        return sum(c.nbytes for c in columns) + 8 * len(self._keys)

    # -- internals -------------------------------------------------------------------------------
    def _location(self, slot: int) -> Location:
        return Location(int(self._region[slot]), int(self._offset[slot]) * self._unit,
                        int(self._length[slot]) * self._unit, int(self._generation[slot]),
                        int(self._hits[slot]))

    def _grow(self) -> int:
        slot = len(self._keys)
        self._keys.append(None)
        if slot >= len(self._region):
            size = 2 * len(self._region)
            self._region = _resized(self._region, size, -1)
            self._offset = _resized(self._offset, size, 0)
            self._length = _resized(self._length, size, 0)
            self._hits = _resized(self._hits, size, 0)
            self._shape_id = _resized(self._shape_id, size, 0)
            self._generation = _resized(self._generation, size, 0)
            self._nbytes = _resized(self._nbytes, size, 0)
        return slot

    def _intern(self, shape: _Shape) -> int:
        found = self._shape_ids.get(shape)
        if found is not None:
            self._shape_refs[found] += 1
            return found
        if self._free_shapes:
            new = self._free_shapes.pop()
            self._shapes[new] = shape
            self._shape_refs[new] = 1
        else:
            new = len(self._shapes)
            self._shapes.append(shape)
            self._shape_refs.append(1)
        self._shape_ids[shape] = new
        return new

    def _release_shape(self, shape_id: int) -> None:
        if shape_id == 0:
            return
        self._shape_refs[shape_id] -= 1
        if self._shape_refs[shape_id] == 0:
            del self._shape_ids[self._shapes[shape_id]]
            self._shapes[shape_id] = _PLAIN
            self._free_shapes.append(shape_id)


def _resized(column: npt.NDArray[G], size: int, fill: int) -> npt.NDArray[G]:
    out = np.full(size, fill, dtype=column.dtype)
    out[: len(column)] = column
    return out
