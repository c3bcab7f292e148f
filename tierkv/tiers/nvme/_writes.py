"""The NVMe tier's write-behind of region buffers: ranges, sealed regions, region headers.

Separate from the append log (`_log`) because it is the only code that writes region buffers
to the device: chunking into device-aligned pieces, background tasks per region, and what a failed
write drops. Entries are packed (`nvme_layout.entry_size`), so a buffer's filled part may end
inside a device block; a write never covers a block twice within one use of a region (a torn
rewrite could damage entries an earlier flush made durable): write-behind issues only whole
chunks the entries have filled, and a write up to the buffer's end (a flush, a seal) first pads
the last block with a padding record (`nvme_layout.write_padding`), so the next entry starts in a
fresh block and `Region.durable` stays a multiple of the block. `RegionWrites` holds the tier's
`LogState` and nothing else. Under the state's lock except the background tasks it starts, which
nothing cancels: whoever waits for them (`drain`) waits without cancelling them (`_tasks.settle`).
"""

from __future__ import annotations

import asyncio
import itertools

from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import padding_size, write_padding, write_region_header
from tierkv.tiers.nvme._regions import EARLIER, Region, RegionState, Superseded
from tierkv.tiers.nvme._state import LogState, log
from tierkv.tiers.nvme._tasks import settle, spawn, wait_all
from tierkv.tiers.nvme.io._aligned import AlignedBuffer

#: write-behind piece size, also the device-offset multiple the pieces are cut at
WRITE_CHUNK = 1 << 20


def write_failure(name: str, index: int, exc: Exception) -> DeviceError:
    """What a region write that raised `exc` failed with. Any exception counts as the write's
    failure, not only `DeviceError`: the background writes record a failure only as one, and
    anything else escaped their task unseen, so the region counted as written (sealed, then
    synced by a flush that returned) and the writes waiting for its header waited forever."""
    if isinstance(exc, DeviceError):
        return exc
    return DeviceError(f"{name}: writing region {index} failed: {exc!r}")


class RegionWrites:
    """Writing region buffers to the device in the background; see `tierkv.tiers.nvme.tier`."""

    __slots__ = ("_st",)

    def __init__(self, state: LogState) -> None:
        self._st = state

    async def write_region_header(self, region: Region, waiting: list[Region], end: int
                                  ) -> None:
        """Write `region`'s new header, with the entries a reclaim copied into it (up to `end`),
        in one write; then `waiting` no longer wait for its old records."""
        st = self._st
        try:
            await self.write_buffer(region, 0, end, urgent=True, whole=True)
        except DeviceError as exc:
            if region.failed is None:
                region.failed = exc  # the old header stands: `waiting` keep waiting
        else:
            region.header_written = True
            st.pending_drops.pop(region.index, None)
            for other in waiting:
                other.shadows.discard(region.index)
        st.changed.set()  # `settle_superseded` may wait for either outcome

    async def write_empty(self, region: Region, seq: int, waiting: list[Region], *,
                          after: Region | None = None) -> None:
        """Write a header of a new, empty use `seq` to the FREE `region` (reclaimed and kept
        FREE for the checkpoint): its old records are stale on media then, and `waiting` no
        longer wait for them. If the write fails the old header stands: `waiting` keep waiting
        (until its next use's header is written) and it is reused like a failed region.
        `after`: the head the reclaim copied entries into, whose writes issued so far go
        first; if one fails, the old header stands too (those entries' old records stay valid
        on media until the region's next use)."""
        st = self._st
        _d, io, sb = st.dev_io()
        if after is not None:
            await wait_all(after.writes)  # those issued so far: not the later ones too
            if after.failed is not None:
                if region.state is RegionState.FREE and region.failed is None:
                    region.failed = after.failed
                st.changed.set()
                return
        buf = st.pool.acquire(st.align)
        try:
            write_region_header(buf.view, sb.uuid, seq, region.index, st.align)
            await io.write(buf, st.offset(region.index), st.align, urgent=True)
        except Exception as exc:
            failure = write_failure(st.name, region.index, exc)
            log.error("%s: writing the empty header of region %d failed: %s", st.name,
                      region.index, failure)
            if region.state is RegionState.FREE and region.failed is None:
                region.failed = failure
        else:
            st.counters["bytes_written"] += st.align
            st.pending_drops.pop(region.index, None)
            for other in waiting:
                other.shadows.discard(region.index)
        finally:
            st.pool.release(buf)
        st.changed.set()

    async def write_sealed(self, region: Region) -> None:
        """The seal task of `region` (state SEALING); its end frees the seal slot, see
        `LogState.sealing`."""
        st = self._st
        try:
            await self.drain(region)
        except DeviceError as exc:
            log.error("%s: writing region %d failed: %s", st.name, region.index, exc)
            self.drop_failed(region, exc)
        else:
            region.state, region.written_at = RegionState.SEALED, st.syncs_begun
            region.supersedes = {}  # its records now supersede on media (a new dict frees it)
        finally:
            if region.buffer is not None:
                st.pool.release(region.buffer)
                region.buffer = None

    def drop_failed(self, region: Region, exc: DeviceError) -> None:
        """`region`'s write failed: drop what the failed writes carried, queue tombstones.

        Everything before `Region.failed_at` reached the media (earlier flushes returned on it):
        those entries stay indexed and the region becomes SEALED, keeping its shadows, as if it
        had been sealed there. Entries ending past that point are dropped, their keys reported
        at once (`LogState.drop`) and returned by the next `put`. A failed header leaves none of
        this use on media, and a region keeping nothing becomes FREE: regions shadowing it keep
        waiting until its next header is written (what of this use reached the media stays
        valid for a scan until then). What the dropped part superseded, and the dropped keys
        (older versions of them, earlier in this region, in older ones or in what of the failed
        part reached the media, would come back at a scan), is queued (`Superseded`) to be
        tombstoned again in the head by the next operation under the lock; keys stored again
        meanwhile make their new region wait for the older ones at once. The caller releases
        the buffer.
        """
        st = self._st
        st.failed_write(exc)
        cut = region.failed_at or 0  # 0: its header failed, so nothing of this use counts
        lost, kept = [], False
        for key in st.index.keys_in_region(region.index):
            loc = st.index.get(key)
            assert loc is not None
            if loc.offset + loc.length > cut:
                lost.append(key)
            else:
                kept = True
        for key in lost:
            st.forget(key)
        superseded = {key for key, end in region.supersedes.items() if end > cut}
        # a tombstone or overwrite before the cut supersedes on media only while this region
        # is there, so it stays SEALED for those too; so does a head resumed at open, whose
        # records below the resume point (tombstones too) are on media (`_resume`)
        kept = kept or len(superseded) < len(region.supersedes) or cut >= region.resumed_at > 0
        keys = frozenset(superseded.union(lost))
        if keys:
            # a shadowed region reused since this one opened (a newer seq) is named by EARLIER:
            # its earlier use holds the records, stale once the new use's header is on media
            older = {(index, seq if seq < region.seq else EARLIER)
                     for index in region.shadows for seq in (st.regions[index].seq,)}
            older.add((region.index, region.seq))
            item = Superseded(keys, tuple(sorted(older)))
            st.superseded.append(item)
            for key in keys:
                loc = st.index.get(key)
                if loc is not None:
                    st.inherit(st.regions[loc.region], item.regions)
        region.supersedes = {}
        if kept:
            region.state, region.used = RegionState.SEALED, min(region.used, cut)
            region.written_at = st.syncs_begun
        else:
            region.shadows, region.state = set(), RegionState.FREE
            st.reserve.free += 1
        st.drop(lost)  # last: the owner is told in a consistent state

    def retire_head(self, head: Region, exc: DeviceError) -> None:
        """The head's write failed at a flush (its writes are all done): drop it like a sealed
        region whose write failed, so that a later flush can succeed in a fresh head."""
        st = self._st
        log.error("%s: writing head region %d failed: %s", st.name, head.index, exc)
        st.head = None
        self.drop_failed(head, exc)
        if head.buffer is not None:
            st.pool.release(head.buffer)
            head.buffer = None
        st.changed.set()

    async def write_buffer(self, region: Region, start: int, end: int, *,
                           urgent: bool = False, whole: bool = False) -> None:
        """Write `region`'s buffer ``[start, end)`` to its place on the device, in pieces split
        at chunk boundaries unless `whole` (one write: a region's header with what must reach
        the media with it)."""
        st = self._st
        _d, io, _sb = st.dev_io()
        assert region.buffer is not None
        buffer: AlignedBuffer = region.buffer
        base = st.offset(region.index)
        # split at device offsets that are multiples of the chunk, as fio's 1 MiB blocks are
        cuts = [start, *range((base + start) // WRITE_CHUNK * WRITE_CHUNK + WRITE_CHUNK - base,
                              end, WRITE_CHUNK), end]
        failed_from = start
        try:
            if len(cuts) == 2 or whole:
                await io.write(buffer, base + start, end - start, start, urgent=urgent)
            else:
                # every piece ends before a failure is raised: the buffer is released after it
                pieces = list(itertools.pairwise(cuts))
                results = await asyncio.gather(*(io.write(buffer, base + a, b - a, a)
                                                 for a, b in pieces), return_exceptions=True)
                for (a, _b), result in zip(pieces, results, strict=True):
                    if isinstance(result, BaseException):
                        failed_from = a  # the pieces before it are on media
                        raise result
        except Exception as exc:
            if region.failed_at is None or failed_from < region.failed_at:
                region.failed_at = failed_from
            failure = write_failure(st.name, region.index, exc)
            if failure is exc:
                raise
            raise failure from exc
        st.counters["bytes_written"] += end - start

    def write_behind(self, region: Region, *, whole_chunks: bool = False) -> None:
        """Start writing the part of `region`'s buffer not yet issued, in the background.

        ``whole_chunks``: only up to the last chunk boundary (on the device), leaving the tail for
        the next call, so a fill is written in full-size, chunk-aligned pieces the entries filled
        completely. Otherwise up to the buffer's end, padded to the next block boundary first.
        """
        st = self._st
        if not whole_chunks:
            self.pad(region)
        start, end = region.durable, region.used
        if whole_chunks:
            base = st.offset(region.index)
            end = (base + end) // WRITE_CHUNK * WRITE_CHUNK - base
        if end <= start:
            return
        region.durable = end  # issued: the task below writes it whatever happens to its caller
        spawn(self._write_range(region, start, end), region.writes)

    def pad(self, region: Region) -> None:
        """End `region`'s records on a device-block boundary with a padding record; no await."""
        st = self._st
        size = padding_size(region.used, st.align)
        if size and region.buffer is not None:
            _d, _io, sb = st.dev_io()
            write_padding(region.buffer.view, region.used, sb.uuid, seq=region.seq, size=size)
            region.used += size

    async def _write_range(self, region: Region, start: int, end: int) -> None:
        # after the use's header, never before: a record of a use whose header a crash lost
        # stayed on media, found by no scan (the old header stood, so the use's seq was issued
        # again at the next open), until a later use of the region took that seq and a scan
        # took the record for one of its own
        st = self._st
        while not region.header_written and region.failed is None:
            await st.wait_changed()
        if not region.header_written:
            return  # the header failed: nothing of this use counts (`drop_failed`)
        try:
            await self.write_buffer(region, start, end)
        except DeviceError as exc:
            if region.failed is None:
                region.failed = exc  # surfaces at the region's seal or the next flush

    async def drain(self, region: Region) -> None:
        """Issue what is left of `region`'s buffer, wait for all its writes; raise a failure.

        Cancelled, it leaves the writes going (`region.durable` counts them issued).
        """
        self.write_behind(region)
        await settle(region.writes)
        if region.failed is not None:
            raise region.failed

    def seal_in_place(self, head: Region) -> None:
        """At close: the flushed head becomes an ordinary sealed region."""
        st = self._st
        if head.buffer is not None:
            st.pool.release(head.buffer)
            head.buffer = None
        head.state, head.written_at = RegionState.SEALED, -1  # flushed: synced
        head.supersedes = {}
        st.head = None
