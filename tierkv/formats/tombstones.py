"""The engine's record of deletes a failing device refused: tombstones, by key and generation.

A tombstone ``(key, bound)`` says: every copy of `key` whose generation is at most `bound` is
dead, wherever it lies. Generations only grow, so a tombstone stays true for good: an old
record found beside a newer one, or applied twice, is harmless. The record is the payload of
an object the engine keeps for itself (`tierkv.keys.TOMBSTONES_KEY`), so the tier's object
header already checksums it; this layout is strict on its own too: a record that is not
exactly ``magic, count, count times (bound, key length, key)`` fails to decode.

    magic   4 bytes  b"TKTB"
    count   u32
    entries count times (bound u64, key length u16, key bytes)

The same layout under another magic (`UNPUBLISHED_MAGIC`, every bound 0) holds the keys whose
invalidation the shared tier's server has not taken yet, kept across a restart
(`tierkv.engine._shared`).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from tierkv.errors import CorruptObjectError
from tierkv.keys import MAX_KEY_SIZE

MAGIC = b"TKTB"
UNPUBLISHED_MAGIC = b"TKUP"
_HEAD = struct.Struct("<4sI")
_ENTRY = struct.Struct("<QH")
#: longest key a record holds: any canonical key (its length is a u16)
MAX_KEY = MAX_KEY_SIZE


def encode_tombstones(bounds: Mapping[bytes, int], magic: bytes = MAGIC) -> bytes:
    """The record of `bounds` (key → generation bound), keys in sorted order."""
    parts = [_HEAD.pack(magic, len(bounds))]
    for key in sorted(bounds):
        if len(key) > MAX_KEY:
            raise ValueError(f"a tombstone's key is longer than {MAX_KEY} bytes")
        parts.append(_ENTRY.pack(bounds[key], len(key)))
        parts.append(key)
    return b"".join(parts)


def decode_tombstones(data: bytes | bytearray | memoryview, magic: bytes = MAGIC
                      ) -> dict[bytes, int]:
    """The bounds a record holds; `CorruptObjectError` unless `data` is exactly one record
    under `magic`."""
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise CorruptObjectError("tombstone record: shorter than its head")
    found, count = _HEAD.unpack_from(view)
    if found != magic:
        raise CorruptObjectError("tombstone record: not a tombstone record (magic)")
    bounds: dict[bytes, int] = {}
    offset = _HEAD.size
    for _ in range(count):
        if offset + _ENTRY.size > len(view):
            raise CorruptObjectError("tombstone record: truncated entry")
        bound, length = _ENTRY.unpack_from(view, offset)
        offset += _ENTRY.size
        if offset + length > len(view):
            raise CorruptObjectError("tombstone record: truncated key")
        key = bytes(view[offset:offset + length])
        offset += length
        if key in bounds:
            raise CorruptObjectError("tombstone record: a key listed twice")
        bounds[key] = bound
    if offset != len(view):
        raise CorruptObjectError("tombstone record: bytes after its last entry")
    return bounds
