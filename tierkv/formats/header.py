"""The object header: what every object on persistent media starts with.

Layout (little endian)::

    magic "TKVH" | version u16 | reserved u16 | body length u32 | body xxh3-64 u64 | body

The body is a msgpack array ``[key, kind, dtype, shape, payload_length, payload_checksum,
parents, generation, flags]``. Decoding is strict: the magic, version, body checksum, every field's
type and the consistency of kind/dtype/shape/length are checked, and anything else raises
`CorruptObjectError`. msgpack only ever yields plain data here; nothing is unpickled.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from tierkv.errors import CorruptObjectError, LimitExceededError
from tierkv.formats.value import ObjectMeta, ValueKind, shape_limit, validate_meta
from tierkv.keys import MAX_KEY_SIZE

MAGIC = b"TKVH"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sHHIQ")
#: where the prefix's fields lie, for writers that fill it field by field (the native put, which
#: checks at load that it agrees: `tierkv.tiers.pmem._native`)
LEAD_SIZE = struct.calcsize("<4sHH")  # magic, version, reserved
BODY_LENGTH_OFFSET = LEAD_SIZE
BODY_CHECKSUM_OFFSET = struct.calcsize("<4sHHI")
#: msgpack's widest encoding of the payload checksum (0xcf and 8 bytes): a writer that learns
#: the checksum only after copying the payload places the payload behind a header of this width
WIDEST_CHECKSUM = len(msgpack.packb(2**64 - 1))
MAX_BODY = 1 << 20
MAX_KEY = MAX_KEY_SIZE
MAX_PARENTS = 4096
#: the header bytes the persistent tiers' size checks (`footprint`, `can_ever_hold`) count an
#: object's header as, at most: the pmem tier's record allowance less its record prefix (the
#: nvme log allows 256); a key of some 60 bytes with one parent of the same size fits in it
SIZED_HEADER = 232
#: the widest uint a header field holds (the generation and checksum are msgpack uints)
_WIDEST_UINT = 2**64 - 1
_FIELDS = 9
#: msgpack's fixarray header for the body's nine fields
_ARRAY_OF_FIELDS = bytes([0x90 | _FIELDS])


_LEAD = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, 0, 0)[:LEAD_SIZE]


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The payload checksum stored in headers (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    key: bytes
    meta: ObjectMeta
    payload_checksum: int
    flags: int = 0

    @property
    def payload_length(self) -> int:
        return self.meta.nbytes


def encode_header(header: ObjectHeader) -> bytes:
    """The header's bytes; `LimitExceededError` (a `ValueError`) for what `decode_header` would
    refuse (`header_limit`, and a body over `MAX_BODY`)."""
    parts = encode_header_parts(header.key, header.meta, header.flags)
    return parts.assemble(header.payload_checksum)


@dataclass(frozen=True, slots=True)
class HeaderParts:
    """A header cut around its payload checksum, for writers that learn the checksum while they
    copy the payload (the pmem tier's native put): ``lead`` is the prefix's first `LEAD_SIZE`
    bytes (magic, version, reserved), ``head`` the msgpack body before the checksum field and
    ``tail`` the body after it. msgpack's encoding of an array is its header followed by its
    elements', so ``head + packb(checksum) + tail`` is exactly the body `encode_header` writes."""

    lead: bytes
    head: bytes
    tail: bytes

    @property
    def widest_size(self) -> int:
        """The header's length with the widest checksum encoding (`WIDEST_CHECKSUM`)."""
        return PREFIX.size + len(self.head) + WIDEST_CHECKSUM + len(self.tail)

    def assemble(self, payload_checksum: int) -> bytes:
        body = self.head + msgpack.packb(payload_checksum) + self.tail
        return self.lead + PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), checksum(body))[
            len(self.lead) :] + body


def encode_header_parts(key: bytes, meta: ObjectMeta, flags: int = 0) -> HeaderParts:
    """`encode_header` without the checksum (see `HeaderParts`); the same `LimitExceededError`s.
    The body is measured with the widest checksum, whichever the payload turns out to have."""
    if not key or not all(meta.parents):
        raise ValueError("a header's key and parent keys are never empty")
    exceeded = header_limit(key, meta)
    if exceeded is not None:
        raise exceeded
    # each packed as a short array whose own header (one byte: fixarray) is cut off
    head = msgpack.packb([key, int(meta.kind), meta.dtype, list(meta.shape), meta.nbytes],
                         use_bin_type=True)
    tail = msgpack.packb([list(meta.parents), meta.generation, flags], use_bin_type=True)
    parts = HeaderParts(_LEAD, _ARRAY_OF_FIELDS + head[1:], tail[1:])
    body = parts.widest_size - PREFIX.size
    if body > MAX_BODY:
        # `header_length` refuses it before it is parsed: written, it would be freed as corrupt
        raise LimitExceededError("header body bytes", MAX_BODY, body)
    return parts


def header_excess(key: bytes, meta: ObjectMeta) -> int:
    """Bytes by which a header of `key` and `meta`, written with any generation and checksum,
    exceeds `SIZED_HEADER`; 0 for most objects (measured by packing only past the cheap bound).
    The engine counts them in the object's size (`IndexEntry.nbytes`): a tier sized an object
    by its payload and `SIZED_HEADER`, took one with a long key or many parents just under its
    limit, and refused it at the write, at every demotion and every flush, for good."""
    if PREFIX.size + _body_bound(key, meta) <= SIZED_HEADER:
        return 0
    try:
        parts = encode_header_parts(key, meta.with_generation(_WIDEST_UINT))
    except (LimitExceededError, ValueError):  # refused before it is stored (`check_header`)
        return 0
    return max(0, parts.widest_size - SIZED_HEADER)


def header_limit(key: bytes, meta: ObjectMeta) -> LimitExceededError | None:
    """The first bound of the header format (other than the body's size, known once packed)
    that a header of `key` and `meta` exceeds, as the error that says so; None within them.

    The one statement of these bounds: `encode_header` raises the error, `decode_header` turns
    it into `CorruptObjectError`, so nothing is written that would not be read back."""
    if len(key) > MAX_KEY:
        return LimitExceededError("key bytes", MAX_KEY, len(key))
    if len(meta.parents) > MAX_PARENTS:
        return LimitExceededError("parents", MAX_PARENTS, len(meta.parents))
    longest = max(map(len, meta.parents), default=0)
    if longest > MAX_KEY:
        return LimitExceededError("parent key bytes", MAX_KEY, longest)
    return shape_limit(meta.shape)


def check_header(key: bytes, meta: ObjectMeta) -> None:
    """Raise `LimitExceededError` unless a header of `key` and `meta` can be written and read
    back whatever generation and payload checksum it is written with later: the check of the
    public calls, made before anything changes (a write-back put is written to media only at a
    demotion or a flush, long after it was acknowledged)."""
    exceeded = header_limit(key, meta)
    if exceeded is not None:
        raise exceeded
    if _body_bound(key, meta) <= MAX_BODY:
        return  # every put checks: packing a header to measure it would cost ~8 µs of each
    encode_header_parts(key, meta.with_generation(_WIDEST_UINT))


#: bytes of a body besides its keys, dtype and sizes, at most: the fixarray, msgpack's widest
#: headers of the key, dtype and two arrays (5 bytes each) and its widest uints (9 bytes each:
#: kind, length, generation, flags, checksum)
_BODY_OVERHEAD = 1 + 4 * 5 + 5 * 9


def _body_bound(key: bytes, meta: ObjectMeta) -> int:
    """An upper bound of the body's bytes: each key, parent and size at msgpack's widest."""
    return (_BODY_OVERHEAD + 5 + len(key) + len(meta.dtype) + 9 * len(meta.shape)
            + sum(map(len, meta.parents)) + 5 * len(meta.parents))


def header_length(buf: bytes | bytearray | memoryview) -> int:
    """Total header length from its prefix, after checking magic and version."""
    if len(buf) < PREFIX.size:
        raise CorruptObjectError("truncated header prefix")
    magic, version, reserved, body_len, _sum = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptObjectError("bad header magic")
    if version != FORMAT_VERSION:
        raise CorruptObjectError(f"unsupported header version {version}")
    if reserved != 0:
        raise CorruptObjectError("reserved header bits are set")
    if body_len > MAX_BODY:
        raise CorruptObjectError(f"header body of {body_len} bytes is too large")
    return int(PREFIX.size + body_len)


def decode_header(buf: bytes | bytearray | memoryview) -> tuple[ObjectHeader, int]:
    """Decode the header at the start of `buf`; returns it and its length in bytes."""
    total = header_length(buf)
    if len(buf) < total:
        raise CorruptObjectError("truncated header body")
    body_sum = PREFIX.unpack_from(buf, 0)[4]
    body = bytes(memoryview(buf)[PREFIX.size : total])
    if checksum(body) != body_sum:
        raise CorruptObjectError("header checksum mismatch")
    try:
        fields = msgpack.unpackb(
            body, raw=False, use_list=False, strict_map_key=True, max_bin_len=MAX_KEY
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CorruptObjectError(f"header body is not valid msgpack: {exc}") from exc
    return _header_from_fields(fields), total


def _header_from_fields(fields: Any) -> ObjectHeader:
    if not isinstance(fields, tuple) or len(fields) != _FIELDS:
        raise CorruptObjectError("header body is not a 9-field array")
    key, kind, dtype, shape, length, payload_sum, parents, generation, flags = fields
    if not isinstance(key, bytes) or not key:
        raise CorruptObjectError("header key is not non-empty bytes")
    if not _is_uint(kind) or kind not in ValueKind._value2member_map_:
        raise CorruptObjectError(f"unknown value kind {kind!r}")
    if not isinstance(dtype, str):
        raise CorruptObjectError("header dtype is not a string")
    if not isinstance(shape, tuple) or not all(_is_uint(d) for d in shape):
        raise CorruptObjectError("header shape is not a tuple of sizes")
    if not all(_is_uint(v) for v in (length, payload_sum, generation, flags)):
        raise CorruptObjectError("header length, checksum, generation or flags is not a uint")
    if not isinstance(parents, tuple):
        raise CorruptObjectError("header parents is not a list of keys")
    if not all(isinstance(p, bytes) and p for p in parents):
        raise CorruptObjectError("header parent is not non-empty bytes")
    value_kind = ValueKind(kind)
    validate_meta(value_kind, dtype, shape, length)
    meta = ObjectMeta(value_kind, dtype, shape, length, generation, parents)
    exceeded = header_limit(key, meta)
    if exceeded is not None:
        raise CorruptObjectError(f"header out of bounds: {exceeded}")
    return ObjectHeader(key, meta, payload_sum, flags)


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def verify_payload(header: ObjectHeader, payload: bytes | bytearray | memoryview) -> None:
    """Raise `CorruptObjectError` unless `payload` is exactly the bytes `header` describes."""
    if len(payload) != header.payload_length:
        raise CorruptObjectError(
            f"payload is {len(payload)} bytes, header says {header.payload_length}"
        )
    if checksum(payload) != header.payload_checksum:
        raise CorruptObjectError("payload checksum mismatch")
