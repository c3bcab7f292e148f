"""The superblock of the NVMe log: the device's first `SUPERBLOCK_SIZE` bytes, which say what
the rest is (layout version, granularity, geometry, uuid, where the checkpoint lies, the
history record).

Apart from the entries because it is what an open reads before it trusts anything else: a
device that is not a log this code reads is refused here (`ForeignFormatError`, with
`BlankSuperblockError` and `OlderLayoutError` for the cases the tier tells apart). Its fields are
listed in the package docstring (`tierkv.formats.nvme_layout`).
"""

from __future__ import annotations

import struct
import uuid as uuid_module
from dataclasses import dataclass, replace

from tierkv.errors import CorruptObjectError
from tierkv.formats.header import checksum
from tierkv.formats.nvme_layout._entries import ENTRY_GRANULARITY, PREFIX

SUPERBLOCK_SIZE = 4096
SUPERBLOCK_MAGIC = b"TKVNVME\x00"
LAYOUT_VERSION = 2  # 2: entries packed at `granularity`, padding records at flushes

_SB = struct.Struct("<8sIIQQQ16sIQQI")
_SB_SUM = struct.Struct("<Q")
_SB_REGION = struct.Struct("<I")
_SB_HISTORY = struct.Struct("<QIIQ")
_SB_HISTORY_AT = SUPERBLOCK_SIZE - _SB_SUM.size - _SB_HISTORY.size
MAX_CHECKPOINT_REGIONS = (_SB_HISTORY_AT - _SB.size) // _SB_REGION.size


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
