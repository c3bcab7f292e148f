"""The NVMe tier's flush barrier, and the close that ends the log with one.

Separate from the tier's public surface because it is where the log waits for its writes to reach
the media and answers for their failures: a flush settles the background seals (and first the
tombstones a failed write left: `RegionLog.settle_superseded`), writes the head's unwritten part,
syncs, raises the first write failure seen since the last flush, and only then records the head
in the superblock (`CheckpointIO.record_newest`); close flushes, once more after a failure so
that those tombstones reach another region, writes the checkpoint when a flush succeeded, and
releases buffers, backend and device once every background write is done, even when cancelled.
`LogFlush` holds the tier's `LogState`, the write-behind (`RegionWrites`), the append log
(`RegionLog`) and the checkpoints (`CheckpointIO`).
"""

from __future__ import annotations

import os

from tierkv._concurrency import outlive_cancel
from tierkv.errors import DeviceError
from tierkv.tiers.nvme._checkpoint import CheckpointIO
from tierkv.tiers.nvme._log import RegionLog
from tierkv.tiers.nvme._state import LogState, log
from tierkv.tiers.nvme._tasks import settle
from tierkv.tiers.nvme._writes import RegionWrites


class LogFlush:
    """Flushes and closes one tier's log (see the module docstring)."""

    def __init__(self, state: LogState, writes: RegionWrites, region_log: RegionLog,
                 checkpoint: CheckpointIO) -> None:
        self._st = state
        self._writes = writes
        self._log = region_log
        self._checkpoint = checkpoint

    async def flush_locked(self) -> None:
        """Flush under the lock. Cancelled, it leaves every background write going and any
        failure seen so far (`write_error`) for the next flush to raise."""
        st = self._st
        await settle(st.sealing)
        if st.superseded:  # one pass: failures of the regions it writes wait for the next
            await self._log.settle_superseded()
            await settle(st.sealing)
        _d, io, _sb = st.dev_io()
        head = st.head
        if head is not None:
            try:
                await self._writes.drain(head)
            except DeviceError as exc:
                self._writes.retire_head(head, exc)  # sets `write_error`
        await io.sync()
        error, st.write_error = st.write_error, None
        if error is not None:
            raise error
        await self._checkpoint.record_newest()  # after the sync: that region is on media

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
            os.close(st.device.fd)
            st.device = None
