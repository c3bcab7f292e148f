"""The NVMe tier's log state, in one owner: `LogState`, with its geometry and index bookkeeping.

`NvmeTier` is built from layers, each an object in its own module that holds this state and the
layers below it: the write-behind of region buffers (`_writes`); on top of that the append
log with region reclaim (`_log`) and, apart from it, checkpoints (`_checkpoint`) under
open-time recovery (`_recovery`); the flush barrier and the close (`_flush`) hold the writes,
the log and the checkpoints. The state is created once by `NvmeTier.__init__` and
shared by reference, so every layer sees the same regions, index, head, lock and counters; see
`tierkv.tiers.nvme.tier` for the contract. Helpers here touch nothing but the state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from tierkv.config import NvmeTierConfig
from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import ENTRY_GRANULARITY, SUPERBLOCK_SIZE, Superblock
from tierkv.formats.value import ObjectMeta
from tierkv.tiers.base import ReclaimWorth
from tierkv.tiers.nvme._device import Device
from tierkv.tiers.nvme._index import Location, NvmeIndex
from tierkv.tiers.nvme._regions import Region, RegionState, RegionTable, Superseded
from tierkv.tiers.nvme._reserve import CheckpointReserve, meta_weight
from tierkv.tiers.nvme.io._aligned import AlignedPool
from tierkv.tiers.nvme.io._blockio import BlockIO

#: the records of every layer keep the tier's logger name, as before the tier was split up
log = logging.getLogger("tierkv.tiers.nvme.tier")

#: sealed regions written in the background at once; a rotation waits for a slot
SEALS_IN_FLIGHT = 2

#: what the state reports dropped keys to (the tier's `Tier._dropped`), and whether for room
DropReport = Callable[[Sequence[bytes], bool], None]


class LogState:
    """Everything the NVMe tier's layers share: device handles, regions, index, head, counters.

    Owned by one `NvmeTier`; its layers hold a reference and read and write the attributes
    directly (no copies). Mutations of the log (appends, rotations, reclaims, the start of a
    flush) happen under `lock`; reads of entries and a flush's waits, sync and superblock
    record (`_flush`) do not take it. `changed` is set whenever a sealing task
    ends (a seal slot frees: `sealing` holds fewer than `SEALS_IN_FLIGHT`), a region's header
    write ends or its readers drop to zero, for the waits of rotation, reclaim and
    `settle_superseded` (`wait_changed`). `sealing` holds the seal tasks in flight, each until
    it is done (`_tasks.spawn`): the slot count is the tasks' own state, so no slot can be
    taken by a waiter that was cancelled, or given back by anyone else. `device`, `io` and `sb`
    are ``None`` until open (and after close).
    """

    __slots__ = ("changed", "config", "counters", "damaged", "device", "failures",
                 "failures_raised",
                 "flushes", "head", "index", "io", "last_flush", "live", "lock", "lost", "name",
                 "next_seq", "on_drop", "pending_drops", "pool", "reclaim_worth",
                 "recovered_from",
                 "region_count", "regions", "reserve", "reuse_failed", "sb", "sealing",
                 "superseded", "synced", "syncs_begun", "tick",
                 "write_error")

    def __init__(self, name: str, config: NvmeTierConfig, region_count: int,
                 on_drop: DropReport) -> None:
        self.name = name
        self.config = config
        self.region_count = region_count
        self.device: Device | None = None
        self.io: BlockIO | None = None
        self.pool = AlignedPool()
        self.sb: Superblock | None = None
        self.index = NvmeIndex(ENTRY_GRANULARITY, weigh=meta_weight)
        self.regions = RegionTable(0)
        #: the FREE regions kept for the checkpoint (`_reserve`), recounted at open; before
        #: it, what an empty log keeps (so `capacity` does not change at open)
        self.reserve = CheckpointReserve(config.region_size, region_count)
        self.reserve.tally((), 0)
        self.reserve.hold(self.index)
        self.head: Region | None = None
        self.next_seq = 1
        self.tick = 0
        self.lock = asyncio.Lock()
        self.sealing: set[asyncio.Task[None]] = set()
        self.changed = asyncio.Event()
        #: told of every key the log drops on its own, in the step that drops it (`drop`)
        self.on_drop = on_drop
        #: what the owner says each entry a reclaim may copy forward is worth
        #: (`Tier.set_reclaim_worth`); ``None``: those read at least `reinsert_hits` times
        self.reclaim_worth: ReclaimWorth | None = None
        #: keys dropped and not yet returned by a `put` (which returns them all, see `drop`)
        self.lost: list[bytes] = []
        self.superseded: list[Superseded] = []
        #: keys a reclaim dropped, by the region they were in, until that region's next header
        #: is on media: till then a crash brings their records back, so a delete of one writes a
        #: tombstone although the index no longer holds it (`NvmeTier.delete`)
        self.pending_drops: dict[int, set[bytes]] = {}
        #: False only for close's last flush: a region whose write failed is then a last resort
        self.reuse_failed = True
        #: the last write or sync failure, how many there were, and how many of them a flush
        #: has raised (`failed_write`; a flush raises what came since it began or before it and
        #: was not raised yet)
        self.write_error: DeviceError | None = None
        self.failures = 0
        self.failures_raised = 0
        #: the flushes' own tasks (`LogFlush._complete`), and the last one begun: each records
        #: the superblock after the one before it
        self.flushes: set[asyncio.Task[None]] = set()
        self.last_flush: asyncio.Task[None] | None = None
        #: the flushes' syncs begun, and the highest number (in that count) of one that ended:
        #: a region whose write ended before sync number n began is synced once n ended
        #: (`Region.written_at`)
        self.syncs_begun = 0
        self.synced = 0
        self.recovered_from = "new"
        #: keys whose newest record the scan at open found damaged (`Tier.damaged_at_open`)
        self.damaged: set[bytes] = set()
        self.live = 0
        self.counters = {"checksum_failures": 0, "bytes_read": 0, "bytes_written": 0,
                         "regions_reclaimed": 0, "entries_reinserted": 0, "entries_dropped": 0,
                         "checkpoint_skipped": 0, "regions_unordered": 0,
                         "regions_unidentified": 0,
                         "tombstones_applied": 0,
                         "reserve_reclaims": 0}

    # -- geometry --------------------------------------------------------------------------------
    @property
    def align(self) -> int:
        """The device block: what IO offsets, lengths and buffers are multiples of."""
        return self.device.alignment if self.device is not None else 4096

    @property
    def grain(self) -> int:
        """What entries are packed at: the log's recorded granularity (`entry_size`)."""
        return self.sb.granularity if self.sb is not None else ENTRY_GRANULARITY

    def offset(self, region: int) -> int:
        return SUPERBLOCK_SIZE + region * self.config.region_size

    def dev_io(self) -> tuple[Device, BlockIO, Superblock]:
        assert self.device is not None and self.io is not None and self.sb is not None
        return self.device, self.io, self.sb

    async def wait_changed(self) -> None:
        """Wait for the next `changed`; the caller then checks its condition again. Holds
        nothing, so a cancellation here leaves no trace."""
        self.changed.clear()
        await self.changed.wait()

    def drop(self, keys: Sequence[bytes], *, for_room: bool = False) -> None:
        """`keys` were just dropped from the index by the log itself (a reclaim, `for_room`;
        a failed write): tell the owner now (`on_drop`), and keep them for the next `put` to
        return, which may be another than the one that dropped them (or none, if that one was
        cancelled)."""
        if keys:
            self.lost.extend(keys)
            self.on_drop(keys, for_room)

    def failed_write(self, exc: DeviceError) -> None:
        """A region write or a sync failed: the next flush, and any running, raises it."""
        self.write_error = exc
        self.failures += 1

    # -- index helpers ---------------------------------------------------------------------------
    def reset_index(self) -> None:
        """An empty index over all-FREE regions (once the superblock is known, before a
        checkpoint is loaded or a scan, or after a checkpoint failed)."""
        self.index = NvmeIndex(self.grain, weigh=meta_weight)
        self.regions = RegionTable(self.region_count)
        self.damaged = set()
        self.live = 0
        self.reserve.tally(self.regions, 0)
        self.reserve.hold(self.index)

    def insert(self, key: bytes, region: Region, *, offset: int, length: int,
               meta: ObjectMeta, hits: int) -> None:
        old = self.index.put(key, region=region.index, offset=offset, length=length, meta=meta,
                             hits=hits)
        if old is not None:
            self.regions[old.region].live -= old.length
            self.live -= old.length
            self.shadow(region, old)
            if old.region != region.index and region.state is RegionState.HEAD:
                region.supersedes[key] = offset + length
        region.live += length
        self.live += length

    def shadow(self, region: Region, old: Location | None) -> None:
        """`region` now holds a record superseding `old` (an overwrite or a tombstone)."""
        if old is not None and old.region != region.index:
            region.shadows.add(old.region)

    def inherit(self, target: Region, regions: tuple[tuple[int, int], ...]) -> None:
        """`target` now holds the newest record of keys that `regions` (``(index, seq)``) may
        still hold older records of (see `Superseded`): it waits for those regions too.

        A region reused since (another seq, or `EARLIER`) counts only when its new header
        failed: once that header is on media its old records are stale. One whose header is
        still in flight is skipped here; `RegionLog.settle_superseded` waits for it first.
        """
        for index, seq in regions:
            other = self.regions[index]
            if index != target.index and index not in target.shadows and (
                other.seq == seq or (not other.header_written and other.failed is not None)
            ):
                target.shadows.add(index)
                # the head's are counted already; another region's shadows grow only here
                self.reserve.regions_bytes += self.reserve.shadow_bytes()

    def forget(self, key: bytes) -> Location | None:
        old = self.index.remove(key)
        if old is not None:
            self.regions[old.region].live -= old.length
            self.live -= old.length
        return old
