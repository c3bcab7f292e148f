"""The region header of the NVMe log: the first block of each region, naming its device
(uuid), its index and the seq of its current use.

Apart from the entries that follow it because a region's header is written when a region is
opened for writing and read first at a scan, to tell a region's current use from stale data;
the entries' own prefixes carry the seq it gives them.
"""

from __future__ import annotations

import struct

from tierkv.formats.header import checksum

REGION_MAGIC = b"TKVREGN\x00"
_REGION = struct.Struct("<8s16sQIIQ")


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
