"""Per-region bookkeeping of the NVMe tier (in DRAM only; the media holds region headers)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tierkv.errors import DeviceError
from tierkv.tiers.nvme.io._aligned import AlignedBuffer


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
    # bytes from the region start up to the end of its last record (an entry, or the padding
    # that ends a write on a block boundary: see `RegionWrites.write_behind`)
    used: int = 0
    live: int = 0  # footprint bytes of the entries the index points at
    # bytes of the buffer whose write was issued (write-behind) or done; always a multiple of
    # the device block, so no block is written twice in one use of the region
    durable: int = 0
    # bytes of this use a flush wrote and synced (`LogFlush._complete`): what of a HEAD or
    # SEALING region outlives a crash for sure (`NvmeTier.on_media`)
    synced_to: int = 0
    # `LogState.syncs_begun` when this use's write as a whole ended (it became SEALED); a sync
    # begun after it puts it on media for sure. -1: a region found on media at open
    written_at: int = -1
    # where appends of this use began at this open (`_resume`); 0: a use opened by this process.
    # Its records below are on media, tombstones among them: a failed write above keeps them
    resumed_at: int = 0
    writes: set[asyncio.Task[None]] = field(default_factory=set)  # write-behind in flight
    failed: DeviceError | None = None  # the first write-behind failure of this use
    # The lowest buffer offset a failed write of this use began at: everything before it
    # reached the media (`RegionWrites.drop_failed` keeps the entries there). 0: the header.
    failed_at: int | None = None
    readers: int = 0  # device reads in flight; a region with readers is never reclaimed
    last_access: int = 0
    buffer: AlignedBuffer | None = None
    header_written: bool = False  # this use's region header is on media (its old records stale)
    # Older regions holding records that a record here supersedes (an overwrite or a tombstone).
    # This region is reclaimed only once they are gone, or a scan after a crash would find the
    # older record with nothing newer and bring it back.
    shadows: set[int] = field(default_factory=set)
    # Keys whose older records (in an older region, or earlier in this one) a record here
    # supersedes: its tombstones and cross-region overwrites, each with the end offset of its
    # latest such record. Kept only until the region is durably written (emptied once SEALED):
    # if a write fails, those whose record lies in what failed are tombstoned again
    # (`Superseded`), else a scan would bring the older records back.
    supersedes: dict[bytes, int] = field(default_factory=dict)


#: the seq `Superseded` names an earlier use of a region by (no use has it)
EARLIER = -1


@dataclass(frozen=True, slots=True)
class Superseded:
    """What a region whose write failed had superseded, to be tombstoned again in the head.

    `keys`: the keys of its `Region.supersedes` and of its entries whose records lay in what
    failed (their older versions, in older regions, earlier in it or in what of the failed part
    reached the media, must not resurface). `regions`: ``(index, seq)`` of the
    regions that may still hold older records of them on media (its own shadows and itself;
    seq `EARLIER` for a use before the region's current one); the region holding the new
    tombstones must not be reclaimed before them.
    """

    keys: frozenset[bytes]
    regions: tuple[tuple[int, int], ...]


class RegionTable:
    """The log's regions, each made on first use, so that a capacity never written costs no
    memory: regions are taken lowest index first (`first_free`), and those past the highest
    one ever touched exist only as a count. Iterating yields the regions made so far; every
    other region is FREE and has never held anything in this process.
    """

    __slots__ = ("_made", "count")

    def __init__(self, count: int) -> None:
        self.count = count
        self._made: list[Region] = []

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Region]:
        return iter(self._made)

    def __getitem__(self, index: int) -> Region:
        made = self._made
        if index >= len(made):
            if not 0 <= index < self.count:
                raise IndexError(index)
            made.extend(Region(i) for i in range(len(made), index + 1))
        return made[index]

    @property
    def made(self) -> int:
        """How many regions have been made: the DRAM the table costs, in regions."""
        return len(self._made)

    def first_free(self, usable: Callable[[Region], bool] = lambda _r: True) -> Region | None:
        """The lowest-indexed FREE region that is `usable`, making a fresh one if no region
        made so far qualifies; ``None`` when there is none at all."""
        for region in self._made:
            if region.state is RegionState.FREE and usable(region):
                return region
        if len(self._made) < self.count:
            return self[len(self._made)]
        return None

    def free_indices(self, wanted: int) -> list[int]:
        """Indices of up to `wanted` FREE regions, lowest first (fresh ones made as needed)."""
        free = [r.index for r in self._made if r.state is RegionState.FREE][:wanted]
        while len(free) < wanted and len(self._made) < self.count:
            free.append(self[len(self._made)].index)
        return free
