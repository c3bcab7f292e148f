"""NvmeTier (L3): a log of fixed-size regions on a file or block device, O_DIRECT, io_uring.

Layout on media: `tierkv.formats.nvme_layout`. Puts append ``prefix | object header (with the
key) | payload`` entries, checksummed and packed back to back at the log's granularity (64
bytes), into the in-memory *head* region buffer; a full head is sealed and written whole in the
background (at most two regions in flight) while a fresh head takes new puts. Write-behind:
whenever 1 MiB or more of the head is unwritten, a put starts writing it in the background in
whole 1 MiB pieces aligned on the device (the tail waits for the next put), so large objects go
to the device at once; `flush()` pads the head to the next device block (a padding record) and
writes its unwritten part and waits for every write, so no block holding flushed entries is
ever written again (`_writes`). Region buffers come prefaulted on transparent huge pages from
the pool and are reused (see `io._aligned`). Reads of entries still in a buffer are served from
memory; other reads go to the device through the IO backend, the entry's span rounded out to
whole blocks, into a pooled aligned buffer and the entry is copied out, so the caller owns what
`get` returns. Deletes append a tombstone entry.

Space: `capacity` is the region area (region count times region size) less the regions kept
FREE for the checkpoint (see Recovery). When no region is free beyond those, puts reclaim a
whole *victim* region — oldest first (``eviction = "fifo"``) or least recently read (``"lru"``),
or, while live entries fill at most half the log and `reinsert_hits` is not 0, the one with
the fewest live bytes (`_keep.choose_victim`) — that no read is using: its entries that the
owner values (`Tier.set_reclaim_worth`, most valuable first; without it, those read at least
`reinsert_hits` times since they were written, most read first; none where `reinsert_hits` is
0) are copied into the head as far as they leave room for the entry that needed it, the rest
are dropped and their keys returned by that `put` (keys dropped by a reclaim inside `delete`,
or inside a `put` that was cancelled, are returned by the next `put`). Every key the tier drops
on its own (reclaim, for room; a failed region write or an entry failing its checksum at `get`,
not for room) is reported to the drop listener (`Tier.set_drop_listener`) on the loop, in the
step that drops it, before anything else runs;
that includes the previous entry of the key a `put` is storing, which the put's return leaves
out. An entry must fit in one region (`can_ever_hold`); `fits` is therefore true for anything
`can_ever_hold` accepts.

Format (`_recovery`): a usable log is always recovered and new media always formatted; other
media is overwritten with ``format = true`` and refused (`DeviceError`) with ``false``.

Recovery: a clean `close()` writes an index checkpoint (msgpack, checksummed) into free regions
and records it in the superblock; `open` loads it when valid and at once clears it from the
superblock (so a later crash scans). So that a full log has room for it, the log keeps as many
regions FREE as an upper bound of the checkpoint of its current index needs (`_reserve`: per
entry its key and metadata bytes plus a fixed part at the widest encodings, plus the regions
table): a rotation reclaims a victim rather than take one of them, and a put that would make the
checkpoint outgrow them first reclaims a victim into FREE (one region every time the bound
crosses a region's worth; its hot entries go into the head where they fit). `capacity` leaves
them out (as of the last rotation or such reclaim), and so does `room()`. The reservation is
all or nothing: a log whose checkpoint would need more than the superblock can list, or leave
fewer than two regions for data (a log of two regions), keeps none. Otherwise the index is
rebuilt by scanning region entry headers (`_scan`). Entries failing a checksum are never
served: at scan they are dropped, at `get` the key becomes a miss; both are counted
(``checksum_failures``); at scan a damaged record whose object header still names its key is
that key's tombstone (its older records are not served in its place), reported by
`damaged_at_open` unless a newer record of the key follows it. A crash never brings
back a deleted, overwritten or dropped entry once
the delete/overwrite was flushed: a region holding a record that supersedes one in an older
region (an overwrite or a tombstone) is not reclaimed before that older region
(`Region.shadows`; the oldest sealed region is always eligible, so LRU degrades towards FIFO
only under heavy overwriting), and a region taken for reuse gets its new header written first
of its writes (in the background, not holding puts; the use's other writes wait for it: a
record on media before its header is found by no scan, and a crash between them left the use's
seq to be issued again, to a use that took the record for its own), which makes its old records
stale for the scan; regions superseding those records become reclaimable only once that write
has completed.
A failed region write (EIO, ENOSPC...) loses only what it carried: the region up to its first
failed piece is on media (earlier flushes stay true, live and after reopen) and stays SEALED with
those entries (`RegionWrites.drop_failed`); later entries are dropped. Their records never
reached the media (or only in part), so the older records they superseded would come back at a
scan: each region keeps, until durably written, the keys it supersedes (`Region.supersedes`: its
tombstones and cross-region overwrites, with where each lies); those in the dropped part and the
dropped keys are tombstoned again in the head by the next put, delete or flush (a key stored
again meanwhile needs none: its new region inherits the wait), in a region that waits for the
older ones and the failed one (`Superseded`). So after a failed write, the next flush that
succeeds makes sure that no deleted, overwritten or dropped entry comes back.
A head whose write fails at `flush()` is retired the same way and the next put opens a fresh
head; `close()` flushes once more after a failure, then reclaiming a victim rather than reusing a
region whose write failed. A region keeping nothing (no record precedes the failure) becomes
free; regions shadowing it wait until its next header is written (what of its failed use reached
the media is valid for a scan until then); a reclaim finding no eligible victim takes such a free
region, so the oldest sealed region waiting only for it cannot stall puts.
Damage (a destroyed header, a file cut short) can lose a region a flush made durable, and a scan
would then serve older records the lost ones superseded. So the first `flush()` after a region
opened records the head in the superblock, after its sync (a superblock write and sync per
region; 64 KiB puts, a flush every 1 MiB: -4% fill rate at 16 MiB regions, -13% at 1 MiB). A scan
not finding that region (or a newer use of its index) drops every older region, as nothing tells
which of their records were superseded, keeps the newer ones and records a floor so later scans
agree (``regions_unordered``; see `_recovery`). An older region whose header is destroyed
makes each key its records name a miss where older (``regions_unidentified``); a region
rolled back to an older intact copy of itself goes undetected.
Media shorter than the log opens with what is left: regions past its end are empty.
At open the newest region takes appends again where it has room (`_resume`), so an open's
first appends reclaim nothing in a full log.
When free regions cannot hold the checkpoint at close (a log too small for the reservation, one
whose every sealed region waited for another when it was to be restored, or writing it fails),
none is recorded and the next open scans. A scan leaves a region whose use holds no entry FREE.

Concurrency: every coroutine may run concurrently on one event loop; appends, deletes, reclaims,
the start of a flush and close's flush and checkpoint are serialised by one `asyncio.Lock`,
reads are not. A flush holds the lock only to issue the head's unwritten part and note the
writes it waits for; the waits, the sync and the superblock record run outside it (`_flush`),
so puts and deletes append while the device syncs.
Cancellation: any await may be cancelled and leaves the log consistent (`_log`): a cancelled
put or delete leaves its key as it was or as it would have left it, every other key untouched;
a cancelled flush leaves its writes and its sync going and its error for the next flush;
background writes never stop because a waiter was cancelled (`_tasks`); a cancelled close skips
the checkpoint (the next open scans) but still releases everything.
Errors: `DeviceError` (with `errno`) when the device fails an operation; a failed background
region write drops the entries it carried (reported at once, and their keys returned by the next
`put`) and `flush()` raises it; so does a failed write of the head at `flush()`, which retires the
head (see Recovery).

Code: `NvmeTier` keeps the public surface, open/close and the data path, and inherits only `Tier`.
One `LogState` (`_state`) owns the log's state (device, IO backend, buffer pool, superblock,
regions, index, head, lock, counters...) and the helpers that touch only it (geometry, index
bookkeeping). The layers are objects that hold that state and the layers below them, each built
once by `NvmeTier.__init__`: `RegionWrites` (`_writes`, write-behind) holds the state;
`RegionLog` (`_log`, the append log and region reclaim) and `CheckpointIO`
(`_checkpoint`) hold it and the writes; `NvmeRecovery` (`_recovery`, open-time
recovery) holds it and the checkpoints; `LogFlush` (`_flush`, the flush barrier and close's
flush, checkpoint and release) holds it, the writes, the log and the checkpoints. The tier holds
all of them and delegates; what it reports (`stats`, `describe`, `probe`) is read from the
state by `_introspection`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tierkv._concurrency import outlive_cancel
from tierkv.config import NvmeTierConfig, TierKind
from tierkv.errors import ConfigError, TierFullError
from tierkv.formats.header import ObjectHeader, checksum, encode_header
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE, TOMBSTONE, entry_size
from tierkv.formats.value import ObjectMeta, Payload, ValueKind, payload_view
from tierkv.tiers.base import ReclaimWorth, RecoveredObject, Tier
from tierkv.tiers.nvme._checkpoint import CheckpointIO
from tierkv.tiers.nvme._device import make_backend, open_device_when_free
from tierkv.tiers.nvme._flush import LogFlush
from tierkv.tiers.nvme._introspection import describe_log, log_stats, probe
from tierkv.tiers.nvme._log import RegionLog
from tierkv.tiers.nvme._recovery import NvmeRecovery
from tierkv.tiers.nvme._regions import RegionState, Superseded
from tierkv.tiers.nvme._resume import resume_head
from tierkv.tiers.nvme._state import SEALS_IN_FLIGHT, LogState, log
from tierkv.tiers.nvme._tasks import settle
from tierkv.tiers.nvme._timing import time_device_read
from tierkv.tiers.nvme._writes import RegionWrites
from tierkv.tiers.nvme.io._blockio import BlockIO

# probe lives with what the tier reports; the tier's public surface keeps it
__all__ = ["HEADER_ALLOWANCE", "NvmeTier", "probe"]

#: bytes reserved for the object header when sizing an object before its header exists
HEADER_ALLOWANCE = 256


class NvmeTier(Tier):
    """The L3 tier; see the module docstring for layout, space, recovery and concurrency."""

    kind = TierKind.NVME
    persistent = True
    reclaims_space = True

    def __init__(self, config: NvmeTierConfig) -> None:
        super().__init__(config.name)
        self.config = config
        self.queue_depth = config.queue_depth
        if config.region_size % 4096 or config.region_size < (1 << 20):
            raise ConfigError(f"{config.name}.region_size: must be a multiple of 4KiB, >= 1MiB")
        region_count = (config.capacity - SUPERBLOCK_SIZE) // config.region_size
        if region_count < 1:
            raise ConfigError(
                f"{config.name}.capacity: {config.path} needs room for the superblock and a region"
            )
        self._st = LogState(config.name, config, region_count, self._dropped)
        self._writes = RegionWrites(self._st)
        self._log = RegionLog(self._st, self._writes)
        self._checkpoint = CheckpointIO(self._st, self._writes)
        self._recovery = NvmeRecovery(self._st, self._checkpoint)
        self._flush = LogFlush(self._st, self._writes, self._log, self._checkpoint)
        #: a hook for fault injection (`tierkv.testing.faults`): wraps the block device the
        #: tier opens, so that injected faults arrive where a failing device's would
        self.wrap_io: Callable[[BlockIO], BlockIO] | None = None

    # -- geometry --------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The region area less the regions kept FREE for the checkpoint (`_reserve`): it
        changes as the index grows or shrinks, at rotations and at reclaims made for it."""
        st = self._st
        return (st.region_count - st.reserve.held) * self.config.region_size

    @property
    def used(self) -> int:
        return self._st.live

    def room(self) -> int:
        """What appends may take before the log must reclaim a region (dropping what that held):
        the rest of the head and the regions that hold nothing, but those kept for the
        checkpoint. Dead entries in sealed regions are not room: their space comes back only
        with their region."""
        st = self._st
        in_use = sum(1 for region in st.regions if region.state is not RegionState.FREE)
        usable = self.config.region_size - st.align  # a region's header takes one block
        head = st.head
        rest = self.config.region_size - head.used if head is not None else 0
        free = st.regions.count - in_use - st.reserve.held
        return max(free, 0) * usable + max(rest, 0)

    def footprint(self, nbytes: int) -> int:
        return entry_size(HEADER_ALLOWANCE, nbytes, self._st.grain)

    def _max_entry(self) -> int:
        return self.config.region_size - self._st.align

    def can_ever_hold(self, nbytes: int) -> bool:
        return self.footprint(nbytes) <= self._max_entry()

    def fits(self, nbytes: int) -> bool:
        return self.can_ever_hold(nbytes)

    # -- lifecycle -------------------------------------------------------------------------------
    def set_reclaim_worth(self, worth: ReclaimWorth | None) -> None:
        self._st.reclaim_worth = worth

    def damaged_at_open(self) -> frozenset[bytes]:
        return frozenset(self._st.damaged)

    async def _open(self) -> list[RecoveredObject]:
        st = self._st
        device = await open_device_when_free(self.config)
        st.device = device
        try:
            st.io = make_backend(self.config, device)
            if self.wrap_io is not None:
                st.io = self.wrap_io(st.io)
            await self._recovery.load_or_format(device)  # makes the index for the log's grain
            st.reserve.tally(st.regions, st.regions.made)
            st.reserve.hold(st.index)
            # the head and the regions being sealed each fill one region buffer: fault them in
            # now, not in the put that rotates the head (a 64 MiB prefault stalled the loop, and
            # each new tier's first fill ran at about half speed; docs/benchmarks-nvme.md)
            st.pool.warm(self.config.region_size, 1 + SEALS_IN_FLIGHT)
            await resume_head(st)
        except BaseException:
            # unlinked while the fd still holds the lock: no other opener can be using it yet
            if device.created:
                with contextlib.suppress(OSError):
                    os.unlink(device.path)
            await outlive_cancel(self._flush.release())
            raise
        recovered = []
        index = st.index  # recovery may have replaced it
        for key in list(index.keys()):
            meta = index.meta(key)
            assert meta is not None
            recovered.append(RecoveredObject(key, meta))
        log.info("%s: opened %s (%s, %s), %d objects recovered from %s", self.name,
                 device.path, st.io.name if st.io else "?",
                 "direct" if device.direct else "buffered", len(recovered), st.recovered_from)
        return recovered

    async def _close(self) -> None:
        """Flush and checkpoint under the lock (operations waiting for it then find the tier
        closed), then release. Cancelled, it skips what is left of the flush and checkpoint
        (the next open scans) but still releases everything, once background writes are done."""
        await self._flush.close()

    # -- data path -------------------------------------------------------------------------------
    async def put(self, key: bytes, meta: ObjectMeta, payload: Payload) -> Sequence[bytes]:
        self._check_open()
        st = self._st
        view = payload_view(payload)
        if not self.can_ever_hold(view.nbytes):
            raise TierFullError(f"{self.name}: {view.nbytes} bytes do not fit in one region")
        if meta.nbytes != view.nbytes:
            raise ValueError(f"meta says {meta.nbytes} bytes, the payload has {view.nbytes}")
        header = encode_header(ObjectHeader(key, meta, checksum(view)))
        size = entry_size(len(header), view.nbytes, st.grain)
        if size > self._max_entry():
            raise TierFullError(f"{self.name}: an entry of {size} bytes does not fit a region")
        async with st.lock:
            self._check_open()  # a close may have run while this put waited for the lock
            if st.superseded:
                await self._log.settle_superseded()
            await self._log.append(key, meta, header, payload=view, flags=0, size=size)
            dropped, st.lost = st.lost, []
        # a reclaim may have dropped this key's previous entry; the key itself is stored
        return [k for k in dropped if k != key]

    async def get(self, key: bytes) -> tuple[ObjectMeta, Payload] | None:
        self._check_open()
        st = self._st
        loc = st.index.get(key)
        if loc is None:
            moving = self._log.in_transit.get(key)  # a reclaim is copying it forward
            if moving is None:
                return None
            return moving.meta, memoryview(bytearray(moving.payload))
        region = st.regions[loc.region]
        st.index.touch(key)
        st.tick += 1
        region.last_access = st.tick
        entry = await self._log.read_entry(region, loc)
        if entry is None or entry[0].key != key:
            current = st.index.get(key)
            if current is not None and (current.region, current.offset) == (loc.region, loc.offset):
                st.forget(key)
                # its record stays on media (a bit may have flipped on the way, not there) until
                # the region is reused: tombstoned at the next write or flush, as a failed write's
                # are, or a scan would bring back an object the cache let go of, even after a
                # delete of its key that then found nothing to delete
                st.superseded.append(Superseded(frozenset((key,)),
                                                ((region.index, region.seq),)))
                self._dropped([key])  # the tier let go of it on its own
            if entry is not None:
                st.counters["checksum_failures"] += 1
            return None
        header, _raw, payload = entry
        return header.meta, payload

    async def delete(self, key: bytes) -> bool:
        self._check_open()
        st = self._st
        async with st.lock:
            self._check_open()
            if st.superseded:
                await self._log.settle_superseded()
            meta = st.index.meta(key)
            if meta is None and not any(key in keys for keys in st.pending_drops.values()):
                return False
            # a key a reclaim dropped whose region's new header is not on media yet: its
            # record there comes back after a crash, unless a tombstone follows it (a delete
            # that returned, then a kill -9, served the deleted value again)
            tomb = ObjectMeta(ValueKind.BYTES, "", (), 0, 0 if meta is None else meta.generation)
            header = encode_header(ObjectHeader(key, tomb, checksum(b"")))
            size = entry_size(len(header), 0, st.grain)
            await self._log.make_room(size)
            # the regions a reclaim dropped the key from: their new headers' writes end first
            # (a header on media makes the dropped record stale; one that failed leaves it)
            for index, keys in list(st.pending_drops.items()):
                if key in keys:
                    await settle(st.regions[index].writes)
            # no await from here: the key leaves the index in the step its tombstone is placed
            # (a reclaim in `make_room` may have dropped it already; the tombstone still goes)
            old = st.forget(key)
            self._log.place(key, tomb, header, payload=b"", flags=TOMBSTONE, size=size,
                            shadowed=old)
            # and the head waits for each region whose new header failed until its next one
            # is on media, as it waits for `old`'s: reclaimed first (a mostly free log reclaims
            # its emptiest region first), a crash left the dropped record the only one of the
            # key on media, and the deleted value came back. (Added while such a write was in
            # flight, the shadow stayed after it succeeded: it names its waiting regions as it
            # starts. The head's shadows are counted in the checkpoint's reserve already.)
            head = st.head
            assert head is not None
            head.shadows.update(index for index, keys in st.pending_drops.items()
                                if key in keys and index != head.index)
        return True

    async def contains(self, key: bytes) -> bool:
        self._check_open()
        return key in self._st.index or key in self._log.in_transit

    def keys(self) -> Iterator[bytes]:
        return self._st.index.keys()

    def on_media(self, key: bytes) -> bool:
        # entries in a buffer, or in a region written since the last sync, are not yet
        st = self._st
        loc = st.index.get(key)
        if loc is None:
            return False
        region = st.regions[loc.region]
        if region.state is RegionState.SEALED:
            return region.written_at < st.synced
        return loc.offset + loc.length <= region.synced_to

    async def flush(self) -> None:
        self._check_open()
        await self._flush.flush(self._check_open)

    # -- introspection ---------------------------------------------------------------------------
    async def time_read(self, nbytes: int) -> float | None:
        self._check_open()
        return await time_device_read(self._st, nbytes)

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        data.update(log_stats(self._st))
        return data

    def describe(self) -> dict[str, str]:
        return describe_log(self._st, self.capacity, self.state)
