"""The NVMe tier's write-behind of region buffers: ranges, sealed regions, region headers.

Separate from the append log (`_nvme_log`) because it is the only code that writes region buffers
to the device: chunking into device-aligned pieces, background tasks per region, and what a failed
write drops. Under the tier's lock except the background tasks it starts.
"""

from __future__ import annotations

import asyncio
import itertools

from tierkv.errors import DeviceError
from tierkv.tiers._aligned import AlignedBuffer
from tierkv.tiers._nvme_regions import EARLIER, Region, RegionState, Superseded
from tierkv.tiers._nvme_state import NvmeTierState, log

#: write-behind piece size, also the device-offset multiple the pieces are cut at
WRITE_CHUNK = 1 << 20


class RegionWrites(NvmeTierState):
    """Writing region buffers to the device in the background; see `tierkv.tiers.nvme`."""

    async def _write_region_header(self, region: Region, waiting: list[Region]) -> None:
        """Write `region`'s new header; then `waiting` no longer wait for its old records."""
        try:
            await self._write_buffer(region, 0, self._align, urgent=True)
        except DeviceError as exc:
            if region.failed is None:
                region.failed = exc  # the old header stands: `waiting` keep waiting
        else:
            region.header_written = True
            for other in waiting:
                other.shadows.discard(region.index)
        self._changed.set()  # `_settle_superseded` may wait for either outcome

    async def _write_sealed(self, region: Region) -> None:
        try:
            await self._drain_writes(region)
        except DeviceError as exc:
            log.error("%s: writing region %d failed: %s", self.name, region.index, exc)
            self._drop_failed(region, exc)
        else:
            region.state = RegionState.SEALED
            region.supersedes = set()  # its records now supersede on media (a new set frees it)
        finally:
            if region.buffer is not None:
                self._pool.release(region.buffer)
                region.buffer = None
            self._seal_slots.release()
            self._changed.set()

    def _drop_failed(self, region: Region, exc: DeviceError) -> None:
        """`region`'s write failed: drop its entries, queue tombstones for what it superseded.

        Its entries' keys are returned by the next `put`. What it superseded (its tombstones and
        overwrites, and its own entries, part of which may have reached the media) would come
        back from older records at a scan, so those keys are queued (`Superseded`) to be
        tombstoned again in the head by the next operation under the lock; keys stored again
        meanwhile make their new region wait for the older ones at once. Regions shadowing
        `region` keep waiting until its next header is written: what of this use reached the
        media stays valid for a scan until then. The region becomes FREE; the caller releases
        its buffer.
        """
        self._write_error = exc
        lost = self._index.keys_in_region(region.index)
        for key in lost:
            self._forget(key)
        self._lost.extend(lost)
        keys = frozenset(region.supersedes.union(lost))
        if keys:
            # a shadowed region reused since this one opened (a newer seq) is named by EARLIER:
            # its earlier use holds the records, stale once the new use's header is on media
            older = {(index, seq if seq < region.seq else EARLIER)
                     for index in region.shadows for seq in (self._regions[index].seq,)}
            older.add((region.index, region.seq))
            item = Superseded(keys, tuple(sorted(older)))
            self._superseded.append(item)
            for key in keys:
                loc = self._index.get(key)
                if loc is not None:
                    self._inherit(self._regions[loc.region], item.regions)
        region.shadows, region.supersedes = set(), set()
        region.state = RegionState.FREE

    def _retire_head(self, head: Region, exc: DeviceError) -> None:
        """The head's write failed at a flush (its writes are all done): drop it like a sealed
        region whose write failed, so that a later flush can succeed in a fresh head."""
        log.error("%s: writing head region %d failed: %s", self.name, head.index, exc)
        self._drop_failed(head, exc)
        if head.buffer is not None:
            self._pool.release(head.buffer)
            head.buffer = None
        self._head = None
        self._changed.set()

    async def _write_buffer(self, region: Region, start: int, end: int, *,
                            urgent: bool = False) -> None:
        _d, io, _sb = self._dev_io()
        assert region.buffer is not None
        buffer: AlignedBuffer = region.buffer
        base = self._offset(region.index)
        # split at device offsets that are multiples of the chunk, as fio's 1 MiB blocks are
        cuts = [start, *range((base + start) // WRITE_CHUNK * WRITE_CHUNK + WRITE_CHUNK - base,
                              end, WRITE_CHUNK), end]
        if len(cuts) == 2:
            await io.write(buffer, base + start, end - start, start, urgent=urgent)
        else:
            await asyncio.gather(*(io.write(buffer, base + a, b - a, a)
                                   for a, b in itertools.pairwise(cuts)))
        self._counters["bytes_written"] += end - start

    def _write_behind(self, region: Region, *, whole_chunks: bool = False) -> None:
        """Start writing the part of `region`'s buffer not yet issued, in the background.

        ``whole_chunks``: only up to the last chunk boundary (on the device), leaving the tail for
        the next call, so a fill is written in full-size, chunk-aligned pieces.
        """
        start, end = region.durable, region.used
        if whole_chunks:
            base = self._offset(region.index)
            end = (base + end) // WRITE_CHUNK * WRITE_CHUNK - base
        if end <= start:
            return
        region.durable = end
        task = asyncio.create_task(self._write_range(region, start, end))
        region.writes.add(task)
        task.add_done_callback(region.writes.discard)

    async def _write_range(self, region: Region, start: int, end: int) -> None:
        try:
            await self._write_buffer(region, start, end)
        except DeviceError as exc:
            if region.failed is None:
                region.failed = exc  # surfaces at the region's seal or the next flush

    async def _drain_writes(self, region: Region) -> None:
        """Issue what is left of `region`'s buffer, wait for all its writes; raise a failure."""
        self._write_behind(region)
        while region.writes:
            await asyncio.gather(*list(region.writes))
        if region.failed is not None:
            raise region.failed

    def _seal_in_place(self, head: Region) -> None:
        """At close: the flushed head becomes an ordinary sealed region."""
        if head.buffer is not None:
            self._pool.release(head.buffer)
            head.buffer = None
        head.state = RegionState.SEALED
        head.supersedes = set()
        self._head = None

