"""The index checkpoint of the NVMe log: its records, the msgpack body and header that encode
them, and how an encoded checkpoint is cut into the regions it is written into.

Apart from the entries because a checkpoint is written at close and read at open only, in
regions the index does not use, and its decoding checks every field's type (the body is the
package docstring's ``[version, uuid, next_seq, regions, entries]``); the superblock records
where it lies and its length and checksum.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from tierkv.errors import CorruptObjectError
from tierkv.formats.header import checksum
from tierkv.formats.nvme_layout._entries import align_up

CHECKPOINT_MAGIC = b"TKVCKPT\x00"
CHECKPOINT_VERSION = 2  # 2: regions carry their shadows list
_CKPT = struct.Struct("<8sQQ")
CHECKPOINT_HEADER = _CKPT.size


@dataclass(frozen=True, slots=True)
class CheckpointRegion:
    index: int
    seq: int
    used: int
    last_access: int
    shadows: tuple[int, ...] = ()  # older regions whose records this one supersedes


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    key: bytes
    region: int
    offset: int
    length: int
    hits: int
    kind: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    generation: int
    parents: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    uuid: bytes
    next_seq: int
    regions: tuple[CheckpointRegion, ...]
    entries: list[CheckpointEntry]


def encode_checkpoint(ckpt: Checkpoint) -> bytes:
    """Header + msgpack body; its length is not aligned (the writer pads it)."""
    body = msgpack.packb(
        [
            CHECKPOINT_VERSION,
            ckpt.uuid,
            ckpt.next_seq,
            [[r.index, r.seq, r.used, r.last_access, list(r.shadows)] for r in ckpt.regions],
            [
                [e.key, e.region, e.offset, e.length, e.hits, e.kind, e.dtype, list(e.shape),
                 e.nbytes, e.generation, list(e.parents)]
                for e in ckpt.entries
            ],
        ],
        use_bin_type=True,
    )
    return _CKPT.pack(CHECKPOINT_MAGIC, len(body), checksum(body)) + body


def checkpoint_chunks(data: bytes, region_size: int, alignment: int) -> list[bytes]:
    """An encoded checkpoint cut into one piece per region it takes, each zero padded to
    `alignment` (the superblock records the unpadded length)."""
    return [piece.ljust(align_up(len(piece), alignment), b"\0")
            for piece in (data[at : at + region_size] for at in range(0, len(data), region_size))]


def checkpoint_total(buf: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(total length, body checksum) from a checkpoint's header; `CorruptObjectError` if bad."""
    magic, length, check = _CKPT.unpack_from(buf, 0)
    if magic != CHECKPOINT_MAGIC:
        raise CorruptObjectError("bad checkpoint magic")
    return CHECKPOINT_HEADER + int(length), int(check)


def decode_checkpoint(buf: bytes | bytearray | memoryview, uuid: bytes) -> Checkpoint:
    total, check = checkpoint_total(buf)
    if len(buf) < total:
        raise CorruptObjectError("truncated checkpoint")
    body = memoryview(buf)[CHECKPOINT_HEADER:total]
    if checksum(body) != check:
        raise CorruptObjectError("checkpoint checksum mismatch")
    try:
        fields = msgpack.unpackb(body, raw=False, use_list=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CorruptObjectError(f"checkpoint is not valid msgpack: {exc}") from exc
    return _checkpoint_from(fields, uuid)


def _uint(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise CorruptObjectError("checkpoint field is not an unsigned integer")
    return value


def _checkpoint_from(fields: Any, uuid: bytes) -> Checkpoint:
    if not isinstance(fields, tuple) or len(fields) != 5:
        raise CorruptObjectError("checkpoint is not a 5-field array")
    version, raw_uuid, next_seq, regions, entries = fields
    if version != CHECKPOINT_VERSION or raw_uuid != uuid:
        raise CorruptObjectError("checkpoint of another version or device")
    if not isinstance(regions, tuple) or not isinstance(entries, tuple):
        raise CorruptObjectError("checkpoint regions or entries are not arrays")
    out_regions = []
    for r in regions:
        if not isinstance(r, tuple) or len(r) != 5 or not isinstance(r[4], tuple):
            raise CorruptObjectError("bad checkpoint region record")
        index, seq, used, last_access = (_uint(v) for v in r[:4])
        out_regions.append(CheckpointRegion(index, seq, used, last_access,
                                            tuple(_uint(v) for v in r[4])))
    out_entries = []
    for e in entries:
        if not isinstance(e, tuple) or len(e) != 11:
            raise CorruptObjectError("bad checkpoint entry record")
        key, region, offset, length, hits, kind, dtype, shape, nbytes, generation, parents = e
        if not isinstance(key, bytes) or not key or not isinstance(dtype, str):
            raise CorruptObjectError("bad checkpoint entry key or dtype")
        if not isinstance(shape, tuple) or not isinstance(parents, tuple):
            raise CorruptObjectError("bad checkpoint entry shape or parents")
        if not all(isinstance(p, bytes) and p for p in parents):
            raise CorruptObjectError("bad checkpoint entry parent")
        out_entries.append(CheckpointEntry(
            key, _uint(region), _uint(offset), _uint(length), _uint(hits), _uint(kind), dtype,
            tuple(_uint(d) for d in shape), _uint(nbytes), _uint(generation), parents,
        ))
    return Checkpoint(raw_uuid, _uint(next_seq), tuple(out_regions), out_entries)
