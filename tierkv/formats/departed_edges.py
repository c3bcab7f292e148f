"""The engine's record of the edges into keys that hold no object: key → its parents.

A key whose object left the cache while something still derives from it keeps its parents'
edges in the DAG (`Dag.unlink_parents`): an invalidation or new value of a parent must still
reach the children through it. Those edges were written only in the departed object's own
header, gone with it; this record keeps them across a restart (`tierkv.engine._departed`). It
is the payload of an object the engine keeps for itself (`tierkv.keys.DEPARTED_EDGES_KEY`), so
the tier's object header checksums it; the layout is strict on its own too: a record that is not
exactly ``magic, count, count times (key, parents)`` fails to decode.

    magic    4 bytes  b"TKDE"
    count    u32
    entries  count times:
               key length u16, key bytes, parent count u16,
               parent count times (parent length u16, parent bytes)
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

from tierkv.errors import CorruptObjectError
from tierkv.keys import MAX_KEY_SIZE

MAGIC = b"TKDE"
_HEAD = struct.Struct("<4sI")
_U16 = struct.Struct("<H")
#: longest key, and most parents of one key, a record holds (their lengths are u16s)
MAX_KEY = MAX_KEY_SIZE
MAX_PARENTS = 0xFFFF


def encode_departed_edges(edges: Mapping[bytes, Sequence[bytes]]) -> bytes:
    """The record of `edges` (departed key → its parents), keys and parents in sorted order."""
    parts = [_HEAD.pack(MAGIC, len(edges))]
    for key in sorted(edges):
        parents = sorted(set(edges[key]))
        if len(parents) > MAX_PARENTS:
            raise ValueError(f"a departed key has more than {MAX_PARENTS} parents")
        for name in (key, *parents):
            if len(name) > MAX_KEY:
                raise ValueError(f"a departed edge's key is longer than {MAX_KEY} bytes")
        parts += [_U16.pack(len(key)), key, _U16.pack(len(parents))]
        for parent in parents:
            parts += [_U16.pack(len(parent)), parent]
    return b"".join(parts)


def decode_departed_edges(data: bytes | bytearray | memoryview) -> dict[bytes, tuple[bytes, ...]]:
    """The edges a record holds; `CorruptObjectError` unless `data` is exactly one record."""
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise CorruptObjectError("departed edges record: shorter than its head")
    magic, count = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObjectError("departed edges record: not a departed edges record (magic)")
    offset = _HEAD.size

    def u16() -> int:
        nonlocal offset
        if offset + _U16.size > len(view):
            raise CorruptObjectError("departed edges record: truncated entry")
        (value,) = _U16.unpack_from(view, offset)
        offset += _U16.size
        return int(value)

    def name() -> bytes:
        nonlocal offset
        length = u16()
        if offset + length > len(view):
            raise CorruptObjectError("departed edges record: truncated key")
        offset += length
        return bytes(view[offset - length:offset])

    edges: dict[bytes, tuple[bytes, ...]] = {}
    for _ in range(count):
        key = name()
        parents = tuple(name() for _ in range(u16()))
        if key in edges:
            raise CorruptObjectError("departed edges record: a key listed twice")
        if len(set(parents)) != len(parents):
            raise CorruptObjectError("departed edges record: a parent listed twice")
        edges[key] = parents
    if offset != len(view):
        raise CorruptObjectError("departed edges record: bytes after its last entry")
    return edges
