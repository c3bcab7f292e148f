"""Per-region bookkeeping of the NVMe tier (in DRAM only; the media holds region headers)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tierkv.tiers._aligned import AlignedBuffer


class RegionState(enum.Enum):
    FREE = "free"  # holds nothing the index points at; may be reused or hold a checkpoint
    HEAD = "head"  # the in-memory buffer puts append to; `durable` bytes of it are on media
    SEALING = "sealing"  # full; its buffer is being written and still serves reads
    SEALED = "sealed"  # on media only; reads go to the device


@dataclass(slots=True)
class Region:
    index: int
    state: RegionState = RegionState.FREE
    seq: int = 0
    used: int = 0  # bytes from the region start up to the end of its last entry
    live: int = 0  # footprint bytes of the entries the index points at
    durable: int = 0  # bytes of the buffer already written (HEAD after a flush)
    readers: int = 0  # device reads in flight; a region with readers is never reclaimed
    last_access: int = 0
    buffer: AlignedBuffer | None = None
