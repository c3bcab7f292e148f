"""The NVMe tier's flush barrier, and the close that ends the log with one.

Separate from the tier's public surface because it is where the log waits for its writes to reach
the media and answers for their failures. A flush holds the lock only for steps that do no device
IO in the ordinary case: it first waits, unlocked, for the seals already in flight (a failed one
queues tombstones); under the lock it writes those tombstones into the head if any
(`RegionLog.settle_superseded`, the failure path), pads the head and issues its unwritten part,
and notes the writes it must wait for; then, unlocked, a task of its own (`_complete`) waits for
them, syncs, and records the head in the superblock (`CheckpointIO.record_newest`), after the
previous flush's record so that superblock writes never overtake each other. Puts and deletes
go on appending meanwhile; what they append after the flush began is the next flush's. The flush
raises the first failure seen since the last flush that raised, and any seen while it ran
(`LogState.failed_write`). Close flushes, once more after a failure so that those tombstones
reach another region, writes the checkpoint when a flush succeeded, and releases buffers,
backend and device once every background write and flush is done, even when cancelled.
`LogFlush` holds the tier's `LogState`, the write-behind (`RegionWrites`), the append log
(`RegionLog`) and the checkpoints (`CheckpointIO`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from tierkv._concurrency import outlive_cancel
from tierkv._fork import keep
from tierkv.errors import DeviceError
from tierkv.tiers.nvme._checkpoint import CheckpointIO
from tierkv.tiers.nvme._log import RegionLog
from tierkv.tiers.nvme._regions import Region, RegionState
from tierkv.tiers.nvme._state import LogState, log
from tierkv.tiers.nvme._tasks import settle, spawn, wait_all
from tierkv.tiers.nvme._writes import RegionWrites


class LogFlush:
    """Flushes and closes one tier's log (see the module docstring)."""

    def __init__(self, state: LogState, writes: RegionWrites, region_log: RegionLog,
                 checkpoint: CheckpointIO) -> None:
        self._st = state
        self._writes = writes
        self._log = region_log
        self._checkpoint = checkpoint

    async def flush(self, check_open: Callable[[], None]) -> None:
        """The tier's `flush`: everything appended before it was called is on media when it
        returns. Cancelled, it leaves every background write and its own sync going, and any
        failure for the next flush to raise."""
        st = self._st
        raised = st.failures_raised
        await wait_all(st.sealing)  # unlocked: a failed seal queues tombstones for `_begin`
        async with st.lock:
            check_open()  # a close may have run while this flush waited for the lock
            head, task = await self._begin()
        await self._end(head, task, raised, locked=False)

    async def flush_locked(self) -> None:
        """Flush with the lock held by the caller (close); as `flush` otherwise."""
        st = self._st
        raised = st.failures_raised
        await settle(st.flushes)  # flushes begun before close end first (none takes the lock)
        await settle(st.sealing)
        head, task = await self._begin()
        await self._end(head, task, raised, locked=True)

    async def _begin(self) -> tuple[Region | None, asyncio.Task[None]]:
        """Under the lock: tombstones a failed write left, then issue the head's unwritten part
        and start the flush's task on the writes in flight now; no device IO but the first."""
        st = self._st
        if st.superseded:  # one pass: failures of the regions it writes wait for the next
            await self._log.settle_superseded()
        head = st.head
        writes = set(st.sealing)
        issued = 0
        if head is not None:
            self._writes.write_behind(head)  # pads the head and issues what is left of it
            writes |= head.writes
            issued = head.durable  # all in `writes`: synced by the task (not what comes after)
        task = spawn(self._complete(head, issued, writes, st.last_flush), st.flushes)
        st.last_flush = task
        return head, task

    async def _complete(self, head: Region | None, issued: int,
                        writes: set[asyncio.Task[None]],
                        previous: asyncio.Task[None] | None) -> None:
        """The flush's own task (nothing cancels it): wait for `writes`, sync (the head is then
        on media up to `issued`), then record the newest region use in the superblock once
        `previous` (the flush begun before) is done. A failure is recorded, for the flush that
        waits for this task and any later one."""
        st = self._st
        seq = head.seq if head is not None else 0
        try:
            await wait_all(writes)
            newest = self._checkpoint.newest_on_media()  # headers written before the sync
            _d, io, _sb = st.dev_io()
            st.syncs_begun += 1
            number = st.syncs_begun
            await io.sync()
            st.synced = max(st.synced, number)
            if head is not None and head.seq == seq and head.failed is None:
                head.synced_to = max(head.synced_to, issued)
            if previous is not None:
                await wait_all({previous})
            if st.failures == st.failures_raised and (head is None or head.failed is None):
                await self._checkpoint.record_newest(newest)  # after the sync: it is on media
        except DeviceError as exc:
            st.failed_write(exc)

    async def _end(self, head: Region | None, task: asyncio.Task[None], raised: int, *,
                   locked: bool) -> None:
        """Wait for the flush's task; retire a head whose write failed; raise a failure seen
        since `raised` (`LogState.failures_raised` when the flush began)."""
        st = self._st
        await wait_all({task})
        task.result()  # a failure of the device is recorded, not raised, by the task
        if head is not None and head.failed is not None:
            async with contextlib.nullcontext() if locked else st.lock:
                if st.head is head:  # not sealed meanwhile
                    await settle(head.writes)  # retiring releases the buffer they write from
                    self._writes.retire_head(head, head.failed)
            while head.state is RegionState.SEALING:
                await wait_all(st.sealing)  # sealed meanwhile: its seal drops what failed
        if st.failures > raised:
            st.failures_raised = max(st.failures_raised, st.failures)
            assert st.write_error is not None
            raise st.write_error

    async def close(self) -> None:
        """The tier's close (`NvmeTier._close`, whose docstring says what it promises)."""
        try:
            async with self._st.lock:
                if await self._flush_at_close():
                    try:
                        await self._checkpoint.write()
                    except DeviceError as exc:
                        # the superblock still names no checkpoint: the next open scans
                        self._st.counters["checkpoint_skipped"] += 1
                        log.error("%s: writing the checkpoint failed (%s)", self._st.name, exc)
        finally:
            await outlive_cancel(self.release())

    async def _flush_at_close(self) -> bool:
        """Flush; after a failure once more. True when a flush succeeded.

        A failed region write drops that region's entries and queues tombstones for what it
        superseded; the second flush writes those into another region, so that a scan at the
        next open cannot bring the superseded records back. To that end it reclaims a victim
        rather than reuse a region whose write failed.
        """
        try:
            await self.flush_locked()
            return True
        except DeviceError as exc:
            log.error("%s: flush at close failed (%s); flushing once more", self._st.name, exc)
        self._st.reuse_failed = False
        try:
            await self.flush_locked()
        except DeviceError as exc:
            log.error("%s: flush at close failed again (%s); no checkpoint written, and a scan "
                      "may bring back entries the failed writes superseded", self._st.name, exc)
            return False
        return True

    async def release(self) -> None:
        """Wait for the background writes (they use the buffers and the device), then release."""
        st = self._st
        await settle(st.flushes)  # they sync and write the superblock
        await settle(st.sealing)
        for region in st.regions:  # a head whose flush failed may still have writes out
            await settle(region.writes)
        for region in st.regions:
            if region.buffer is not None:
                st.pool.release(region.buffer)
                region.buffer = None
        if st.io is not None:
            await st.io.aclose()
            st.io = None
        st.pool.close()
        if st.device is not None:
            keep(st.device.fd)
            os.close(st.device.fd)
            st.device = None
