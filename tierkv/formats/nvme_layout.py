"""On-media layout of the NVMe tier: superblock, regions, entries, index checkpoint.

Little endian throughout. The device (file or block device) is::

    superblock (SUPERBLOCK_SIZE bytes) | region 0 | region 1 | ... | region N-1

Superblock: ``magic "TKVNVME\\0" | version u32 | granularity u32 | region_size u64 | capacity u64 |
region_count u64 | uuid 16s | alignment u32 | checkpoint length u64 | checkpoint xxh3 u64 |
checkpoint region count u32 | region indices u32 (count of them) | ... | newest seq u64 | newest
index u32 | reserved u32 | floor seq u64 | xxh3 of all before it u64`` (the history record and
the checksum end the block). `granularity` is what entries are packed at (`ENTRY_GRANULARITY`
for a log this code formats; a power of two from `PREFIX.size` to `alignment`). Layout version 1
(before entries were packed: each aligned to `alignment`, this field zero) is refused
(`OlderLayoutError`), never read with the new rules. A checkpoint length of 0 means "no valid
checkpoint: scan". The history record (zeros in logs written before it existed: nothing
recorded) names the newest region use a flush made durable (its seq and index); a scan that does
not find that region, or a newer use of its index, knows the newest history is lost. Region uses
older than the floor seq are void: a scan ignores them (set when such a loss was found).

Region: its first `alignment` bytes hold the region header ``magic "TKVREGN\\0" | uuid 16s |
seq u64 | index u32 | reserved u32 | xxh3 u64``; `seq` grows by one each time a region is opened
for writing, so a scan orders regions by age. Entries follow back to back, each starting on a
`granularity` boundary::

    prefix (32 bytes) | object header (formats/header.py, holds the key) | payload | zero pad

Padding: the writer never writes a device block twice within a region use, so an entry a flush
made durable is never in a block a later (possibly torn) write rewrites. Every write of a region
buffer ends on an `alignment` boundary: where the entries end inside a block, a *padding* record
(flag `PADDING`, a prefix whose body is zeros and unchecked: nothing reads it) fills the block up
to its end (`write_padding`), and the next entry starts in a fresh block. A scan accepts a
padding record only when it ends on an `alignment` boundary. Padding costs space at flushes and
seals only (under a block each); at 16 KiB objects and no flushes 99.2 % of an entry is payload.

Prefix: ``magic "TKVE" | flags u16 | reserved u16 | region seq u64 | body length u64 | xxh3 u64``
where the body is object header + payload and the xxh3 covers the tier's uuid and the first 24
prefix bytes. An entry whose seq differs from its region's is stale data from an earlier use of
that region (the scan skips it), which is how a region rewritten in part is read safely. A
tombstone entry (flag `TOMBSTONE`) records a delete; its header has an empty payload. Flags are
`TOMBSTONE`, `PADDING` or none; anything else is damage.

Checkpoint: ``magic "TKVCKPT\\0" | length u64 | xxh3 u64 | msgpack body`` written into regions the
index does not use, listed in the superblock. The body is ``[version, uuid, next_seq, regions,
entries]`` with plain arrays only (see `Checkpoint`); decoding checks every type. Version 2 adds
each region's *shadows* (the older regions whose records it supersedes); a version 1 checkpoint
is refused, so the tier rebuilds by scanning, which recomputes them.

The tier assembles and parses these bytes only through this module: `write_region_header`,
`write_entry`, `write_padding`, `decode_entry` (one entry read back), `scan_entries` (a whole
region at a scan), `checkpoint_chunks` and `checkpoint_total`.
"""

from __future__ import annotations

import struct
import uuid as uuid_module
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from tierkv.errors import CorruptObjectError
from tierkv.formats.header import ObjectHeader, checksum, decode_header, verify_payload
from tierkv.formats.value import ObjectMeta

SUPERBLOCK_SIZE = 4096
SUPERBLOCK_MAGIC = b"TKVNVME\x00"
LAYOUT_VERSION = 2  # 2: entries packed at `granularity`, padding records at flushes
REGION_MAGIC = b"TKVREGN\x00"
ENTRY_MAGIC = b"TKVE"
CHECKPOINT_MAGIC = b"TKVCKPT\x00"
CHECKPOINT_VERSION = 2  # 2: regions carry their shadows list

TOMBSTONE = 0x1
PADDING = 0x2
_FLAGS = (0, TOMBSTONE, PADDING)

#: the granularity entries are packed at in a log this code formats (bytes; see `entry_size`).
#: At least `PREFIX.size`, so that any gap a flush leaves before a block boundary holds a padding
#: record; 64 (a cache line) wastes 32 bytes an entry on average, 0.2 % of a 16 KiB object, and
#: keeps a scan past damage at 16 Ki steps per MiB, each skipping to the next entry magic.
ENTRY_GRANULARITY = 64

_SB = struct.Struct("<8sIIQQQ16sIQQI")
_SB_SUM = struct.Struct("<Q")
_SB_REGION = struct.Struct("<I")
_SB_HISTORY = struct.Struct("<QIIQ")
_SB_HISTORY_AT = SUPERBLOCK_SIZE - _SB_SUM.size - _SB_HISTORY.size
MAX_CHECKPOINT_REGIONS = (_SB_HISTORY_AT - _SB.size) // _SB_REGION.size
_REGION = struct.Struct("<8s16sQIIQ")
PREFIX = struct.Struct("<4sHHQQQ")
_PREFIX_CHECKED = PREFIX.size - 8
_CKPT = struct.Struct("<8sQQ")
CHECKPOINT_HEADER = _CKPT.size


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def new_uuid() -> bytes:
    return uuid_module.uuid4().bytes


def format_uuid(raw: bytes) -> str:
    return str(uuid_module.UUID(bytes=raw))


@dataclass(frozen=True, slots=True)
class Superblock:
    region_size: int
    capacity: int
    region_count: int
    uuid: bytes
    alignment: int
    checkpoint_length: int = 0
    checkpoint_checksum: int = 0
    checkpoint_regions: tuple[int, ...] = ()
    version: int = LAYOUT_VERSION
    newest_seq: int = 0  # 0: no region use recorded
    newest_index: int = 0
    floor_seq: int = 0
    granularity: int = ENTRY_GRANULARITY

    def region_offset(self, index: int) -> int:
        return SUPERBLOCK_SIZE + index * self.region_size

    def without_checkpoint(self) -> Superblock:
        return replace(self, checkpoint_length=0, checkpoint_checksum=0, checkpoint_regions=())

    def with_checkpoint(self, length: int, check: int, regions: tuple[int, ...]) -> Superblock:
        return replace(self, checkpoint_length=length, checkpoint_checksum=check,
                       checkpoint_regions=regions)


class ForeignFormatError(CorruptObjectError):
    """The superblock is not ours (other magic) or of another layout version."""


class BlankSuperblockError(ForeignFormatError):
    """The superblock block is all zeros."""


class OlderLayoutError(ForeignFormatError):
    """A tierkv log of an earlier layout version, which this code does not read."""


def encode_superblock(sb: Superblock) -> bytes:
    if len(sb.checkpoint_regions) > MAX_CHECKPOINT_REGIONS:
        raise ValueError("too many checkpoint regions for the superblock")
    head = _SB.pack(SUPERBLOCK_MAGIC, sb.version, sb.granularity, sb.region_size, sb.capacity,
                    sb.region_count, sb.uuid, sb.alignment, sb.checkpoint_length,
                    sb.checkpoint_checksum, len(sb.checkpoint_regions))
    regions = b"".join(_SB_REGION.pack(i) for i in sb.checkpoint_regions)
    body = (head + regions).ljust(_SB_HISTORY_AT, b"\x00") + _SB_HISTORY.pack(
        sb.newest_seq, sb.newest_index, 0, sb.floor_seq)
    return body + _SB_SUM.pack(checksum(body))


def decode_superblock(buf: bytes | bytearray | memoryview) -> Superblock:
    """Parse a superblock; `ForeignFormatError` for another format or version, else
    `CorruptObjectError` when it is ours but damaged."""
    if len(buf) < SUPERBLOCK_SIZE:
        raise ForeignFormatError("shorter than a superblock")
    if not any(buf[:SUPERBLOCK_SIZE]):
        raise BlankSuperblockError("the superblock is all zeros")
    fields = _SB.unpack_from(buf, 0)
    magic, version = fields[0], fields[1]
    if magic != SUPERBLOCK_MAGIC:
        raise ForeignFormatError("no tierkv NVMe superblock (other magic)")
    if 0 < version < LAYOUT_VERSION:
        raise OlderLayoutError(
            f"a tierkv NVMe log of layout version {version} (entries aligned to the device "
            f"block), which this tierkv no longer reads (layout {LAYOUT_VERSION} packs entries)")
    if version != LAYOUT_VERSION:
        raise ForeignFormatError(f"tierkv NVMe layout version {version}, expected {LAYOUT_VERSION}")
    body = bytes(buf[: SUPERBLOCK_SIZE - _SB_SUM.size])
    if _SB_SUM.unpack_from(buf, SUPERBLOCK_SIZE - _SB_SUM.size)[0] != checksum(body):
        raise CorruptObjectError("superblock checksum mismatch")
    (_m, _v, granularity, region_size, capacity, region_count, raw_uuid, alignment, ck_len,
     ck_sum, ck_count) = fields
    if ck_count > MAX_CHECKPOINT_REGIONS or region_size <= 0 or alignment <= 0:
        raise CorruptObjectError("superblock fields out of range")
    if not valid_granularity(granularity, alignment):
        raise CorruptObjectError("superblock granularity or alignment out of range")
    regions = tuple(
        _SB_REGION.unpack_from(buf, _SB.size + i * _SB_REGION.size)[0] for i in range(ck_count)
    )
    if any(i >= region_count for i in regions):
        raise CorruptObjectError("superblock names a checkpoint region that does not exist")
    newest_seq, newest_index, _r, floor_seq = _SB_HISTORY.unpack_from(buf, _SB_HISTORY_AT)
    if newest_index >= max(region_count, 1):
        raise CorruptObjectError("superblock names a newest region that does not exist")
    return Superblock(region_size, capacity, region_count, raw_uuid, alignment, ck_len, ck_sum,
                      regions, version, newest_seq, newest_index, floor_seq, granularity)


def valid_granularity(granularity: int, alignment: int) -> bool:
    """A power of two from `PREFIX.size` up to `alignment`, itself a power of two."""
    def power_of_two(n: int) -> bool:
        return n > 0 and not n & (n - 1)
    return (power_of_two(granularity) and power_of_two(alignment)
            and PREFIX.size <= granularity <= alignment)


# -- regions -------------------------------------------------------------------------------------
def encode_region_header(uuid: bytes, seq: int, index: int) -> bytes:
    head = _REGION.pack(REGION_MAGIC, uuid, seq, index, 0, 0)[:-8]
    return head + struct.pack("<Q", checksum(head))


def write_region_header(view: memoryview, uuid: bytes, seq: int, index: int,
                        alignment: int) -> None:
    """The region's first block: its header, zero padded to `alignment`."""
    view[:alignment] = encode_region_header(uuid, seq, index).ljust(alignment, b"\0")


def decode_region_header(
    buf: bytes | bytearray | memoryview, uuid: bytes, index: int
) -> int | None:
    """The region's seq, or ``None`` when the block is no valid header of region `index`."""
    magic, raw_uuid, seq, found_index, _r, check = _REGION.unpack_from(buf, 0)
    if magic != REGION_MAGIC or raw_uuid != uuid or found_index != index:
        return None
    if checksum(bytes(buf[: _REGION.size - 8])) != check:
        return None
    return int(seq)


# -- entries -------------------------------------------------------------------------------------
def entry_size(header_len: int, payload_len: int, granularity: int) -> int:
    """Bytes an entry takes in its region: prefix, header and payload, rounded up to the
    log's `granularity` (`Superblock.granularity`)."""
    return align_up(PREFIX.size + header_len + payload_len, granularity)


def padding_size(used: int, alignment: int) -> int:
    """Bytes of padding that take a region filled up to `used` to the next block boundary."""
    return align_up(used, alignment) - used


def encode_prefix(uuid: bytes, flags: int, seq: int, body_len: int) -> bytes:
    head = PREFIX.pack(ENTRY_MAGIC, flags, 0, seq, body_len, 0)[:_PREFIX_CHECKED]
    return head + struct.pack("<Q", checksum(uuid + head))


@dataclass(frozen=True, slots=True)
class EntryPrefix:
    flags: int
    seq: int
    body_len: int


def decode_prefix(
    buf: bytes | bytearray | memoryview, offset: int, uuid: bytes
) -> EntryPrefix | None:
    """The prefix at `offset`, or ``None`` unless its magic and checksum hold."""
    magic, flags, _r, seq, body_len, check = PREFIX.unpack_from(buf, offset)
    if magic != ENTRY_MAGIC:
        return None
    if checksum(uuid + bytes(buf[offset : offset + _PREFIX_CHECKED])) != check:
        return None
    return EntryPrefix(flags, seq, body_len)


def has_entry_magic(buf: bytes | bytearray | memoryview, offset: int) -> bool:
    return bytes(buf[offset : offset + len(ENTRY_MAGIC)]) == ENTRY_MAGIC


def write_entry(view: memoryview, at: int, uuid: bytes, *, seq: int, flags: int, header: bytes,
                payload: bytes | memoryview, size: int) -> None:
    """Assemble ``prefix | header | payload | zero padding`` in ``view[at : at + size]``;
    `size` is `entry_size` of the header and payload."""
    start = at + PREFIX.size
    view[at:start] = encode_prefix(uuid, flags, seq, len(header) + len(payload))
    view[start : start + len(header)] = header
    start += len(header)
    view[start : start + len(payload)] = payload
    start += len(payload)
    view[start : at + size] = bytes(at + size - start)


def write_padding(view: memoryview, at: int, uuid: bytes, *, seq: int, size: int) -> None:
    """A padding record of `size` bytes (`padding_size`, at least `PREFIX.size`) at `at`."""
    if size < PREFIX.size:
        raise ValueError(f"a padding record takes at least {PREFIX.size} bytes, not {size}")
    view[at : at + PREFIX.size] = encode_prefix(uuid, PADDING, seq, size - PREFIX.size)
    view[at + PREFIX.size : at + size] = bytes(size - PREFIX.size)


def _decode_body(data: memoryview, start: int, body_len: int
                 ) -> tuple[ObjectHeader, int, memoryview]:
    """The object header, its length and the payload of the body at `start`; raises
    `CorruptObjectError` unless header and payload check out and fill the body exactly."""
    header, header_len = decode_header(data[start : start + body_len])
    if header_len + header.payload_length != body_len:
        raise CorruptObjectError("entry body length disagrees with its header")
    payload = data[start + header_len : start + body_len]
    verify_payload(header, payload)
    return header, header_len, payload


def decode_entry(data: memoryview, uuid: bytes, seq: int
                 ) -> tuple[ObjectHeader, bytes, memoryview]:
    """The object entry at the start of `data` written in the region use `seq`: its header,
    the header's bytes and a view of its payload; `CorruptObjectError` if anything fails."""
    prefix = decode_prefix(data, 0, uuid)
    if prefix is None or prefix.seq != seq or prefix.flags != 0:
        raise CorruptObjectError("entry prefix damaged")
    header, header_len, payload = _decode_body(data, PREFIX.size, prefix.body_len)
    return header, bytes(data[PREFIX.size : PREFIX.size + header_len]), payload


@dataclass(frozen=True, slots=True)
class ScannedEntry:
    key: bytes
    offset: int
    length: int
    meta: ObjectMeta
    tombstone: bool


@dataclass(frozen=True, slots=True)
class RegionEntries:
    """A scanned region: intact entries in log order, end of the last record (entry or
    padding), damaged ones skipped."""

    used: int
    entries: tuple[ScannedEntry, ...]
    corrupt: int


def _next_candidate(data: bytes | bytearray, offset: int, granularity: int) -> int:
    """The first offset from `offset` on, a multiple of `granularity`, where the entry magic
    starts (``len(data)`` if none): every offset skipped could hold no prefix at all."""
    while True:
        found = data.find(ENTRY_MAGIC, offset)
        if found < 0:
            return len(data)
        if found % granularity == 0:
            return found
        offset = align_up(found, granularity)


def scan_entries(data: bytes | bytearray, uuid: bytes, seq: int, alignment: int,
                 granularity: int) -> RegionEntries:
    """Parse a whole region (`data`, header block first) written in its use `seq`, at every
    `granularity` offset from the end of its header block: an entry counts if its prefix holds
    with this seq (else it is stale: an earlier use of the region, or bytes that are no entry);
    one with a sound prefix but a bad header or payload, unknown flags, or (padding) not ending
    on an `alignment` boundary is counted and skipped; a bad prefix is stepped over granule by
    granule (straight to the next entry magic: the granules between hold no prefix)."""
    offset = used = alignment
    entries: list[ScannedEntry] = []
    corrupt = 0
    view = memoryview(data)
    while offset + PREFIX.size <= len(data):
        prefix = decode_prefix(data, offset, uuid)
        if prefix is None or prefix.seq != seq:
            if prefix is None and has_entry_magic(data, offset):
                corrupt += 1
            offset = _next_candidate(data, offset + granularity, granularity)
            continue
        total = entry_size(0, prefix.body_len, granularity)
        if offset + total > len(data) or prefix.flags not in _FLAGS or (
                prefix.flags == PADDING and (offset + total) % alignment):
            corrupt += 1
            offset = _next_candidate(data, offset + granularity, granularity)
            continue
        used = offset + total
        if prefix.flags != PADDING:
            try:
                header, _len, _payload = _decode_body(view, offset + PREFIX.size,
                                                      prefix.body_len)
            except CorruptObjectError:
                corrupt += 1
            else:
                entries.append(ScannedEntry(header.key, offset, total, header.meta,
                                            prefix.flags == TOMBSTONE))
        offset += total
    return RegionEntries(used, tuple(entries), corrupt)


# -- checkpoint ----------------------------------------------------------------------------------
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
