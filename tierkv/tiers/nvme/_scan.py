"""Rebuilding the NVMe tier's index by scanning region entry headers (no valid checkpoint).

Every region whose first block is a valid region header of this device (magic, uuid, index,
checksum) is read whole and parsed entry by entry. An entry counts only if its prefix checksum
holds and its seq equals the region's (else it is stale data from an earlier use of the region).
An entry whose prefix holds but whose object header or payload fails its checksum is dropped and
counted, and the scan continues after it; a damaged prefix makes the scan step one aligned block
at a time until the next valid prefix.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tierkv.errors import CorruptObjectError
from tierkv.formats.header import decode_header, verify_payload
from tierkv.formats.nvme_layout import (
    PREFIX,
    TOMBSTONE,
    Superblock,
    decode_prefix,
    decode_region_header,
    entry_size,
    has_entry_magic,
)
from tierkv.formats.value import ObjectMeta
from tierkv.tiers.nvme.io._aligned import AlignedPool
from tierkv.tiers.nvme.io._blockio import BlockIO

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class ScannedEntry:
    key: bytes
    offset: int
    length: int
    meta: ObjectMeta
    tombstone: bool


@dataclass(slots=True)
class ScannedRegion:
    index: int
    seq: int
    used: int = 0
    entries: list[ScannedEntry] = field(default_factory=list)
    corrupt: int = 0


async def read_range(io: BlockIO, pool: AlignedPool, offset: int, length: int,
                     chunk: int = _CHUNK) -> bytearray:
    """`length` bytes at `offset` (both aligned), read in concurrent chunks through the pool."""
    out = bytearray(length)

    async def one(start: int) -> None:
        size = min(chunk, length - start)
        buf = pool.acquire(size)
        try:
            await io.read(buf, offset + start, size)
            out[start : start + size] = buf.view[:size]
        finally:
            pool.release(buf)

    await asyncio.gather(*(one(start) for start in range(0, length, chunk)))
    return out


async def scan_regions(io: BlockIO, pool: AlignedPool, sb: Superblock) -> list[ScannedRegion]:
    """The valid regions, oldest first, each with its intact entries in log order."""
    align = sb.alignment
    found: list[ScannedRegion] = []
    head = pool.acquire(align)
    try:
        for index in range(sb.region_count):
            await io.read(head, sb.region_offset(index), align)
            seq = decode_region_header(head.view, sb.uuid, index)
            if seq is not None:
                found.append(ScannedRegion(index, seq))
    finally:
        pool.release(head)
    found.sort(key=lambda r: r.seq)
    for region in found:
        data = await read_range(io, pool, sb.region_offset(region.index), sb.region_size)
        parse_region(memoryview(data), region, sb)
    return found


def parse_region(data: memoryview, region: ScannedRegion, sb: Superblock) -> None:
    align = sb.alignment
    offset = align
    region.used = align
    while offset + PREFIX.size <= len(data):
        prefix = decode_prefix(data, offset, sb.uuid)
        if prefix is None or prefix.seq != region.seq:
            if prefix is None and has_entry_magic(data, offset):
                region.corrupt += 1
            offset += align
            continue
        header_start = offset + PREFIX.size
        total = align_up_entry(prefix.body_len, align)
        if offset + total > len(data):
            region.corrupt += 1
            offset += align
            continue
        region.used = offset + total
        try:
            header, header_len = decode_header(data[header_start : header_start + prefix.body_len])
            payload_start = header_start + header_len
            if header_len + header.payload_length != prefix.body_len:
                raise CorruptObjectError("entry body length disagrees with its header")
            verify_payload(header, data[payload_start : payload_start + header.payload_length])
        except CorruptObjectError:
            region.corrupt += 1
        else:
            region.entries.append(ScannedEntry(header.key, offset, total, header.meta,
                                               bool(prefix.flags & TOMBSTONE)))
        offset += total


def align_up_entry(body_len: int, align: int) -> int:
    return entry_size(0, body_len, align)
