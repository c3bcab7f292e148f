"""The state every layer of the NVMe tier shares, its geometry and its index bookkeeping.

`NvmeTier` is built from layers, each in its own module and using only the layers it derives
from: this state; the write-behind of region buffers (`_nvme_writes`); on top of that the append
log with region reclaim (`_nvme_log`) and, apart from it, checkpoints (`_nvme_checkpoint`) under
open-time recovery (`_nvme_recovery`).
The attributes are declared here and initialised by `NvmeTier.__init__`; see `tierkv.tiers.nvme`
for the contract. Kept separate so that every layer sees one declaration of the shared state.
"""

from __future__ import annotations

import asyncio
import logging

from tierkv.config import NvmeTierConfig
from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE, Superblock
from tierkv.formats.value import ObjectMeta
from tierkv.tiers._aligned import AlignedPool
from tierkv.tiers._blockio import BlockIO
from tierkv.tiers._nvme_device import Device
from tierkv.tiers._nvme_index import Location, NvmeIndex
from tierkv.tiers._nvme_regions import Region, RegionState, Superseded

#: the records of every layer keep the tier's logger name, as before the tier was split up
log = logging.getLogger("tierkv.tiers.nvme")


class NvmeTierState:
    """Declarations of `NvmeTier`'s shared state; geometry and index helpers over it."""

    name: str
    config: NvmeTierConfig
    _region_count: int
    _device: Device | None
    _io: BlockIO | None
    _pool: AlignedPool
    _sb: Superblock | None
    _index: NvmeIndex
    _regions: list[Region]
    _head: Region | None
    _next_seq: int
    _tick: int
    _lock: asyncio.Lock
    _seal_slots: asyncio.Semaphore
    _sealing: set[asyncio.Task[None]]
    _changed: asyncio.Event
    _lost: list[bytes]
    _superseded: list[Superseded]
    _reuse_failed: bool
    _write_error: DeviceError | None
    _recovered_from: str
    _live: int
    _counters: dict[str, int]

    # -- geometry --------------------------------------------------------------------------------
    @property
    def _align(self) -> int:
        return self._device.alignment if self._device is not None else 4096

    def _offset(self, region: int) -> int:
        return SUPERBLOCK_SIZE + region * self.config.region_size

    def _dev_io(self) -> tuple[Device, BlockIO, Superblock]:
        assert self._device is not None and self._io is not None and self._sb is not None
        return self._device, self._io, self._sb

    # -- index helpers ---------------------------------------------------------------------------
    def _insert(self, key: bytes, region: Region, *, offset: int, length: int,
                meta: ObjectMeta, hits: int) -> None:
        old = self._index.put(key, region=region.index, offset=offset, length=length, meta=meta,
                              hits=hits)
        if old is not None:
            self._regions[old.region].live -= old.length
            self._live -= old.length
            self._shadow(region, old)
            if old.region != region.index and region.state is RegionState.HEAD:
                region.supersedes.add(key)
        region.live += length
        self._live += length

    def _shadow(self, region: Region, old: Location | None) -> None:
        """`region` now holds a record superseding `old` (an overwrite or a tombstone)."""
        if old is not None and old.region != region.index:
            region.shadows.add(old.region)

    def _inherit(self, target: Region, regions: tuple[tuple[int, int], ...]) -> None:
        """`target` now holds the newest record of keys that `regions` (``(index, seq)``) may
        still hold older records of (see `Superseded`): it waits for those regions too.

        A region reused since (another seq, or `EARLIER`) counts only when its new header
        failed: once that header is on media its old records are stale. One whose header is
        still in flight is skipped here; `_settle_superseded` waits for it first.
        """
        for index, seq in regions:
            other = self._regions[index]
            if index != target.index and (
                other.seq == seq or (not other.header_written and other.failed is not None)
            ):
                target.shadows.add(index)

    def _forget(self, key: bytes) -> Location | None:
        old = self._index.remove(key)
        if old is not None:
            self._regions[old.region].live -= old.length
            self._live -= old.length
        return old

