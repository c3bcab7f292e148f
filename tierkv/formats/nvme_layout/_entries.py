"""Entries of the NVMe log: the prefix, an object entry, a padding record, and the scan of a
region's entries.

These are the bytes every put appends and every scan walks, so they are apart from the
superblock and the checkpoint: the log's own records, written at format, flush or close. The
rules (packing at `granularity`, padding to a block's end, the prefix's fields and flags) are
the package docstring's (`tierkv.formats.nvme_layout`). `align_up` lives here because packing
is its main use; the checkpoint's pieces are rounded up with it too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tierkv.errors import CorruptObjectError
from tierkv.formats.header import ObjectHeader, checksum, decode_header, verify_payload
from tierkv.formats.value import ObjectMeta

ENTRY_MAGIC = b"TKVE"

TOMBSTONE = 0x1
PADDING = 0x2
_FLAGS = (0, TOMBSTONE, PADDING)

#: the granularity entries are packed at in a log this code formats (bytes; see `entry_size`).
#: At least `PREFIX.size`, so that any gap a flush leaves before a block boundary holds a padding
#: record; 64 (a cache line) wastes 32 bytes an entry on average, 0.2 % of a 16 KiB object, and
#: keeps a scan past damage at 16 Ki steps per MiB, each skipping to the next entry magic.
ENTRY_GRANULARITY = 64

PREFIX = struct.Struct("<4sHHQQQ")
_PREFIX_CHECKED = PREFIX.size - 8


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


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
    #: a damaged record of this use whose object header still names its key: whatever it was
    #: (a newer value, a tombstone), it superseded the key's older records, which must not be
    #: served in its place (the scan takes it as a tombstone; `meta` is its header's)
    damaged: bool = False


@dataclass(frozen=True, slots=True)
class RegionEntries:
    """A scanned region: its entries in log order (intact ones, and the damaged ones whose key
    is still known, flagged `damaged`), end of the last record (entry or padding), and how many
    damaged records were found."""

    used: int
    entries: tuple[ScannedEntry, ...]
    corrupt: int


def _damaged(view: memoryview, offset: int, end: int, length: int, tombstone: bool
             ) -> ScannedEntry | None:
    """The damaged record at `offset` as a `ScannedEntry` flagged `damaged`, when its object
    header (which has a checksum of its own) still decodes, else ``None``: its key is lost."""
    try:
        header, _len = decode_header(view[offset + PREFIX.size : end])
    except CorruptObjectError:
        return None
    return ScannedEntry(header.key, offset, length, header.meta, tombstone, damaged=True)


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
    granule (straight to the next entry magic: the granules between hold no prefix). A damaged
    record of this use whose object header still decodes is listed too, flagged `damaged`, so
    that the key's older records are not taken for its newest (a flipped bit in a tombstone
    would bring a deleted value back, one in an overwrite's payload the value it replaced)."""
    offset = used = alignment
    entries: list[ScannedEntry] = []
    corrupt = 0
    view = memoryview(data)
    while offset + PREFIX.size <= len(data):
        prefix = decode_prefix(data, offset, uuid)
        if prefix is None or prefix.seq != seq:
            if prefix is None and has_entry_magic(data, offset):
                corrupt += 1
                # a prefix failing its checksum whose seq reads as this use's, or one bit off
                # (the flipped bit may be there): this use's record, damaged. One of an earlier
                # use (or of the uuid before a reformat) has another seq: stale however damaged
                if (PREFIX.unpack_from(data, offset)[3] ^ seq).bit_count() <= 1:
                    lost = _damaged(view, offset, len(data), granularity, tombstone=False)
                    if lost is not None:
                        entries.append(lost)
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
                lost = _damaged(view, offset, offset + PREFIX.size + prefix.body_len, total,
                                prefix.flags == TOMBSTONE)
                if lost is not None:
                    entries.append(lost)
            else:
                entries.append(ScannedEntry(header.key, offset, total, header.meta,
                                            prefix.flags == TOMBSTONE))
        offset += total
    return RegionEntries(used, tuple(entries), corrupt)


@dataclass(frozen=True, slots=True)
class UseKeys:
    """What the records of a region whose header is lost still say (`keys_of_any_use`)."""

    #: each key named, with the use (seq) of the newest record naming it
    keys: dict[bytes, int]
    newest_seq: int  # 0: no record of this log
    #: the newest use with a record whose key no longer reads (0: none)
    lost_seq: int


def keys_of_any_use(data: bytes | bytearray, uuid: bytes, floor_seq: int, alignment: int,
                    granularity: int) -> UseKeys:
    """For a region whose header does not decode (a flipped bit, a zeroed block, a region of
    another index written here): the keys named by the records in `data` of this log (`uuid`)
    of any use from `floor_seq` on, whose prefix holds and whose object header decodes, each
    with the newest use naming it. Nothing orders those uses against the rest of the log:
    the scan takes each key as tombstoned as of that use."""
    keys: dict[bytes, int] = {}
    newest = lost = 0
    view = memoryview(data)
    offset = _next_candidate(data, alignment, granularity)
    while offset + PREFIX.size <= len(data):
        prefix = decode_prefix(data, offset, uuid)
        if prefix is None or prefix.seq < floor_seq or prefix.flags not in _FLAGS:
            offset = _next_candidate(data, offset + granularity, granularity)
            continue
        newest = max(newest, prefix.seq)
        end = offset + PREFIX.size + prefix.body_len
        if prefix.flags != PADDING:
            try:
                header, _len = decode_header(view[offset + PREFIX.size : min(end, len(data))])
                keys[header.key] = max(keys.get(header.key, 0), prefix.seq)
            except CorruptObjectError:
                lost = max(lost, prefix.seq)
        step = entry_size(0, prefix.body_len, granularity) if end <= len(data) else granularity
        offset = _next_candidate(data, offset + step, granularity)
    return UseKeys(keys, newest, lost)
