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
    RegionEntries,
    Superblock,
    decode_region_header,
    scan_entries,
)
from tierkv.tiers.nvme.io._aligned import AlignedPool
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


async def scan_regions(io: BlockIO, pool: AlignedPool, sb: Superblock, end: int
                       ) -> list[ScannedRegion]:
    """The valid regions, oldest first, each with its intact entries in log order; `end` is
    the size of the media (nothing at or past it is read)."""
    align = sb.alignment
    headers: list[tuple[int, int]] = []
    head = pool.acquire(align)
    try:
        for index in range(sb.region_count):
            if sb.region_offset(index) + align > end:
                break  # regions lie in index order: this one and the rest are past the end
            await io.read(head, sb.region_offset(index), align)
            seq = decode_region_header(head.view, sb.uuid, index)
            if seq is not None and seq >= sb.floor_seq:
                headers.append((seq, index))
    finally:
        pool.release(head)
    found = []
    for seq, index in sorted(headers):
        offset = sb.region_offset(index)
        length = min(sb.region_size, (end - offset) // align * align)
        data = await read_range(io, pool, offset, length)
        data.extend(bytes(sb.region_size - length))
        found.append(ScannedRegion(index, seq, scan_entries(data, sb.uuid, seq, align,
                                                            sb.granularity)))
    return found
