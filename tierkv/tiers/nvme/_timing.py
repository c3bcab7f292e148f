"""How long a read from the log's device takes: the NVMe tier's answer to `Tier.time_read`.

Why the tier times the device itself: the newest entries of a log are read from the head's
buffer in memory, so a probe object put and read back (what the engine's profile probe does for
other tiers) would time a memory copy, and `select_tier` would then take the log for as fast as
memory. Here a span of `nbytes` is read from the device straight into a buffer of its own,
bypassing every region buffer, from what is written: the superblock for a read of one block, a
region's written part for a longer one. A new log has no longer span written yet (a file system
answers a read of a never-written part of a file without reading the device), and says so.
"""

from __future__ import annotations

import time

from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE, align_up
from tierkv.tiers.nvme._regions import Region, RegionState
from tierkv.tiers.nvme._state import LogState


def _written(region: Region) -> int:
    """Bytes at the start of `region` this use wrote (or issued) to the device."""
    if region.state is RegionState.SEALED:
        return region.used
    return region.durable if region.state is not RegionState.FREE else 0


async def time_device_read(st: LogState, nbytes: int) -> float | None:
    """Seconds one read of `nbytes` (rounded up to whole device blocks) from the device took;
    ``None`` when the device holds no written span that long yet."""
    _device, io, _sb = st.dev_io()
    length = align_up(max(nbytes, 1), st.align)
    offset = 0  # the superblock
    if length > SUPERBLOCK_SIZE:
        region = next((r for r in st.regions if _written(r) >= st.align + length), None)
        if region is None:
            return None
        offset = st.offset(region.index) + st.align  # past the region header
    buf = st.pool.acquire(length)
    try:
        started = time.perf_counter()
        await io.read(buf, offset, length)  # a cancelled read returns once `buf` is free
        seconds = time.perf_counter() - started
        st.counters["bytes_read"] += length
        return seconds
    finally:
        st.pool.release(buf)
