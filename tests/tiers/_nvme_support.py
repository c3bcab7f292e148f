"""Shared helpers of the NVMe tier tests: small configs and a tier opened in a fixture."""

from __future__ import annotations

from pathlib import Path

from tierkv.config import NvmeBackend, NvmeTierConfig, RegionEviction
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.formats.value import ObjectMeta, ValueKind

REGION = 1 << 20


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


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def find_unique(path: Path, needle: bytes) -> int:
    data = path.read_bytes()
    first = data.find(needle)
    assert first >= 0, "pattern not on the media"
    assert data.find(needle, first + 1) < 0, "pattern is not unique on the media"
    return first
