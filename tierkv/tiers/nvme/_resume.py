"""At open: the newest region, if it has room left, becomes the head again (`resume_head`).

Otherwise the first append after an open (the engine writes its own records at once) rotated
into a new region, and in a full log that meant a reclaim of the oldest one, dropping what it did
not copy forward: every restart of a full log cost a region, and a `kill -9` and reopen of a log
over half full lost a region of flushed objects the crashed process still held. Appends go on
after the newest region's last record instead, in its use: the records it holds are on media
(synced at the close that wrote the checkpoint, or by the open after a scan) and are read from
the device as before (`RegionLog.read_entry`); only what follows is ever written, from the next
device block on (no block is written twice in one use; a block a crash left torn, past the last
record the scan found, is skipped). Only the region of the newest use the log has issued: a use
issued after it (a region kept FREE for the checkpoint got an empty header) would hold records
ordered after every record appended here, so then a rotation opens a new head as before. Not a
region the scan found a damaged record in: its extent is unknown (`_recovery` counts such a
region full), and an append over it wrote over the record that made its key a miss, bringing
the key's older value back. Not a region whose header does not read back (damaged since a
checkpoint named it): a later scan dropped it with everything appended, and every older region
with it. A failed write above the resume point keeps the region, with the records below it (its
tombstones may be all it holds: `RegionWrites.drop_failed`).
"""

from __future__ import annotations

from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import align_up, decode_region_header
from tierkv.tiers.nvme._regions import RegionState
from tierkv.tiers.nvme._state import LogState, log


async def resume_head(st: LogState) -> None:
    """Make the newest sealed region the head again where it has room (see the module); a
    failed read of it leaves it sealed, for the first append to rotate past as before."""
    newest = max((r for r in st.regions if r.state is RegionState.SEALED),
                 key=lambda r: r.seq, default=None)
    if newest is None or newest.seq != st.next_seq - 1 or newest.readers:
        return
    start = align_up(newest.used, st.align)
    if start >= st.config.region_size:
        return
    _d, io, sb = st.dev_io()
    block = st.pool.acquire(st.align)
    try:
        # a cancelled read returns once the device is done with the buffer (`BlockIO`)
        await io.read(block, st.offset(newest.index), st.align)
        header = decode_region_header(block.view, sb.uuid, newest.index)
    except DeviceError as exc:
        log.warning("%s: reading the header of region %d failed (%s): the next append opens "
                    "a new region", st.name, newest.index, exc)
        return
    finally:
        st.pool.release(block)
    if header != newest.seq:
        # damaged since the checkpoint named it: appended to, its records (the new ones too)
        # were lost at the next scan, with every older region (the superblock's newest gone)
        log.warning("%s: the header of region %d does not read back: the next append opens a "
                    "new region", st.name, newest.index)
        return
    # the records below `start` stay on the device and are read from there (`read_entry`)
    buffer = st.pool.acquire(st.config.region_size, prefault=True)
    newest.buffer = buffer
    newest.state = RegionState.HEAD
    newest.used = newest.durable = newest.synced_to = newest.resumed_at = start
    newest.failed, newest.failed_at, newest.supersedes = None, None, {}
    st.head = newest
