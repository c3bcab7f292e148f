"""Shared helpers of the NVMe tier tests: small configs, payloads, entry sizes, media walks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierkv.config import NvmeBackend, NvmeTierConfig, RegionEviction
from tierkv.errors import CorruptObjectError
from tierkv.formats.header import ObjectHeader, checksum, decode_header, encode_header
from tierkv.formats.nvme_layout import (
    ENTRY_GRANULARITY,
    PADDING,
    PREFIX,
    SUPERBLOCK_SIZE,
    decode_prefix,
    decode_region_header,
    decode_superblock,
    entry_size,
)
from tierkv.formats.value import ObjectMeta, ValueKind

REGION = 1 << 20
#: the device block of the test filesystems: a region's first one holds its header
BLOCK = 4096


def nvme_config(
    directory: Path,
    *,
    regions: int = 4,
    backend: NvmeBackend = NvmeBackend.THREADS,
    eviction: RegionEviction = RegionEviction.FIFO,
    reinsert_hits: int = 2,
    fmt: bool = False,
    name: str = "tier.log",
) -> NvmeTierConfig:
    return NvmeTierConfig(
        name="nvme",
        capacity=SUPERBLOCK_SIZE + regions * REGION,
        path=directory / name,
        region_size=REGION,
        queue_depth=8,
        backend=backend,
        eviction=eviction,
        reinsert_hits=reinsert_hits,
        format=fmt,
    )


def meta_of(data: bytes, generation: int = 1) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), len(data), generation)


def key(i: int) -> bytes:
    return b"\x02nvme-test-" + str(i).encode()


def payload_for(i: int, size: int) -> bytes:
    """Deterministic, key-specific bytes, so a reader can check what a writer stored."""
    pattern = (b"%08d-" % i) * (size // 9 + 1)
    return pattern[:size]


def entry_bytes(i: int, size: int) -> int:
    """Bytes the entry of `key(i)` holding `payload_for(i, size)` takes in the log (packed)."""
    data = payload_for(i, size)
    header = encode_header(ObjectHeader(key(i), meta_of(data), checksum(data)))
    return entry_size(len(header), size, ENTRY_GRANULARITY)


def per_region(size: int, i: int = 0) -> int:
    """How many entries like `key(i)`'s of `size` payload bytes fill one region, back to back
    (the keys of the tests up to 4 digits long take the same size at the sizes they use)."""
    return (REGION - BLOCK) // entry_bytes(i, size)


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    """Flip the bits of `mask` in the byte at `offset` of the file (all of them by default)."""
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def find_unique(path: Path, needle: bytes) -> int:
    data = path.read_bytes()
    first = data.find(needle)
    assert first >= 0, "pattern not on the media"
    assert data.find(needle, first + 1) < 0, "pattern is not unique on the media"
    return first


@dataclass(frozen=True, slots=True)
class Record:
    """One record of the current use of a region, found by walking the media."""

    region: int
    at: int  # file offset of its prefix
    length: int  # packed size (prefix, body, pad to the log's granularity)
    flags: int
    key: bytes | None  # None for a padding record


def walk_records(media: bytes) -> list[Record]:
    """Every record of every region's current use, as `formats.nvme_layout` lays them out
    (superblock, region headers, prefixes packed at the log's granularity, padding records,
    object headers), bypassing the tier; a region's walk stops at the first bad record."""
    sb = decode_superblock(media[:SUPERBLOCK_SIZE])
    view = memoryview(media)
    found = []
    for index in range(sb.region_count):
        base = sb.region_offset(index)
        if base + sb.alignment > len(media):
            break
        seq = decode_region_header(view[base : base + sb.alignment], sb.uuid, index)
        offset = sb.alignment
        while seq is not None and offset + PREFIX.size <= sb.region_size:
            prefix = decode_prefix(view, base + offset, sb.uuid)
            if prefix is None or prefix.seq != seq:
                break
            length = entry_size(0, prefix.body_len, sb.granularity)
            name = None
            if not prefix.flags & PADDING:
                body = base + offset + PREFIX.size
                try:
                    name = decode_header(view[body : body + prefix.body_len])[0].key
                except CorruptObjectError:
                    break
            found.append(Record(index, base + offset, length, prefix.flags, name))
            offset += length
    return found
