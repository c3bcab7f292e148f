"""Rebuilding the NVMe tier's index by scanning region entry headers (no valid checkpoint).

Every region whose first block is a valid region header of this device (magic, uuid, index,
checksum) and whose use is not older than the superblock's floor is read whole and parsed entry
by entry at the log's granularity, padding records included (`nvme_layout.scan_entries`, which
says what counts). Media shorter than the configured log (a truncated file, a smaller device)
is read up to its end: a region whose header lies past it is absent, one cut by it is read up to
the last whole block before it, the rest counting as zeros (no entries). This module does the
reading; the bytes are the layout's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tierkv.formats.nvme_layout import (
    ENTRY_MAGIC,
    RegionEntries,
    Superblock,
    UseKeys,
    decode_region_header,
    keys_of_any_use,
    scan_entries,
)
from tierkv.tiers.nvme.io._aligned import AlignedBuffer, AlignedPool
from tierkv.tiers.nvme.io._blockio import BlockIO

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class ScannedRegion:
    index: int
    seq: int
    found: RegionEntries  # its entries, the end of the last one, the damaged ones skipped


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


@dataclass(frozen=True, slots=True)
class Unidentified:
    """A region whose header does not decode, but whose records are this log's: what they
    name (`keys_of_any_use`)."""

    index: int
    used: UseKeys


async def scan_regions(io: BlockIO, pool: AlignedPool, sb: Superblock, end: int
                       ) -> tuple[list[ScannedRegion], list[Unidentified]]:
    """The valid regions, oldest first, each with its intact entries in log order, and the
    regions whose header is lost but which hold records of this log; `end` is the size of the
    media (nothing at or past it is read)."""
    align = sb.alignment
    headers: list[tuple[int, int]] = []
    lost: list[int] = []
    head = pool.acquire(align)
    try:
        for index in range(sb.region_count):
            if sb.region_offset(index) + align > end:
                break  # regions lie in index order: this one and the rest are past the end
            await io.read(head, sb.region_offset(index), align)
            seq = decode_region_header(head.view, sb.uuid, index)
            if seq is None:
                if await _holds_entries(io, head, sb, index, end):
                    lost.append(index)
            elif seq >= sb.floor_seq:
                headers.append((seq, index))
    finally:
        pool.release(head)
    found = []
    for seq, index in sorted(headers):
        data = await _read_region(io, pool, sb, index, end)
        found.append(ScannedRegion(index, seq, scan_entries(data, sb.uuid, seq, align,
                                                            sb.granularity)))
    unidentified = []
    for index in lost:
        used = keys_of_any_use(await _read_region(io, pool, sb, index, end), sb.uuid,
                               sb.floor_seq, align, sb.granularity)
        if used.newest_seq:
            unidentified.append(Unidentified(index, used))
    return found, unidentified


async def _holds_entries(io: BlockIO, buf: AlignedBuffer, sb: Superblock, index: int,
                         end: int) -> bool:
    """Whether the first block after region `index`'s header holds an entry magic, where every
    use starts writing: a region never used (zeros) is not read whole at each scan for its
    records; `buf` is a block's buffer."""
    offset = sb.region_offset(index) + sb.alignment
    if offset + sb.alignment > end:
        return False
    await io.read(buf, offset, sb.alignment)
    return ENTRY_MAGIC in bytes(buf.view[: sb.alignment])


async def _read_region(io: BlockIO, pool: AlignedPool, sb: Superblock, index: int, end: int
                       ) -> bytearray:
    """Region `index` whole, what lies past the media's `end` as zeros."""
    offset = sb.region_offset(index)
    length = min(sb.region_size, (end - offset) // sb.alignment * sb.alignment)
    data = await read_range(io, pool, offset, length)
    data.extend(bytes(sb.region_size - length))
    return data
