"""The NVMe tier's append log: entries into the head, rotation, region reclaim and reinsertion.

Separate from the tier's public surface because it is the space policy mechanism of the log:
which region a reclaim takes (`eviction`, `Region.shadows`), which of its entries are copied back
(by the owner's worth, else `reinsert_hits`), and reading an entry back (shared with
`get`). `RegionLog` holds the tier's `LogState` and the write-behind (`RegionWrites`) it seals
regions with. Appends, rotations and reclaims run under the state's lock; reads do not.

Cancellation: the caller under the lock may be cancelled at every await here, so each await
leaves the log consistent and changes nothing it would have to undo. Room for an entry is made
first (`make_room`, the only awaits of an append) and the entry is then placed with no await
(`place`). A rotation waits for a seal slot while the head is still attached, then seals it and
starts its seal task in one step; a reclaim waits and reads the victim's hot entries before it
touches anything, then frees the victim and drops its keys in one step; a head is opened and the
hot entries copied into it in one step. Between those steps the log may have no head, which the
next append opens.

Room for the checkpoint (`_reserve`): the log keeps `CheckpointReserve.needed` regions FREE. A
rotation takes a FREE region for the head only if that many stay FREE, else it reclaims a
victim, as a full log does. A put whose entry would make the checkpoint outgrow the FREE regions
(the index grew, or its entries got smaller) first reclaims a victim into FREE
(`_restore_reserve`): its hot entries go into the head as far as they leave the put its room,
the rest are dropped, and a header of a new, empty use is written to it in the background
(`RegionWrites.write_empty`): no scan brings back what it held, while it waits for a checkpoint.
"""

from __future__ import annotations

import asyncio

from tierkv._concurrency import outlive_cancel
from tierkv.errors import CorruptObjectError, DeviceError
from tierkv.formats.header import ObjectHeader, checksum, encode_header
from tierkv.formats.nvme_layout import (
    TOMBSTONE,
    align_up,
    decode_entry,
    entry_size,
    write_entry,
    write_region_header,
)
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.nvme._index import Location
from tierkv.tiers.nvme._keep import HotEntry, choose_victim, entries_to_keep
from tierkv.tiers.nvme._regions import Region, RegionState, Superseded
from tierkv.tiers.nvme._state import SEALS_IN_FLIGHT, LogState, log
from tierkv.tiers.nvme._tasks import settle, spawn
from tierkv.tiers.nvme._writes import WRITE_CHUNK, RegionWrites


class RegionLog:
    """Appending to the head region and recycling regions; see `tierkv.tiers.nvme.tier`."""

    __slots__ = ("_st", "_writes", "in_transit")

    def __init__(self, state: LogState, writes: RegionWrites) -> None:
        self._st = state
        self._writes = writes
        #: hot entries of a reclaimed victim, out of the index until `_open_head` places them
        #: (`_take_region` awaits in between): lock-free gets are served from here meanwhile
        self.in_transit: dict[bytes, HotEntry] = {}

    async def append(self, key: bytes, meta: ObjectMeta, header: bytes, *,
                     payload: memoryview | bytes, flags: int, size: int) -> None:
        """`make_room`, then `place`; under the lock. Keys it drops go to `LogState.drop`."""
        st = self._st
        grows = st.reserve.entry_bytes(len(key), st.index.weight(meta)) if not flags else 0
        await self.make_room(size, grows)
        self.place(key, meta, header, payload=payload, flags=flags, size=size)

    async def make_room(self, size: int, grows: int = 0) -> None:
        """Rotate until the head has `size` bytes free (a second rotation keeps nothing: never a
        loop), keeping FREE regions for a checkpoint grown by `grows` bytes; under the lock."""
        st, room = self._st, size
        while True:
            if st.head is None or st.head.used + size > st.config.region_size:
                await self._rotate(room)
                room = st.config.region_size
            elif grows and st.reserve.short(st.index, grows):
                await self._restore_reserve(keep=size)  # the room just made stays
            else:
                return

    def place(self, key: bytes, meta: ObjectMeta, header: bytes, *, payload: memoryview | bytes,
              flags: int, size: int, hits: int = 0, shadowed: Location | None = None) -> None:
        """Copy one entry into the head, which has room for it (`make_room`); no await.

        `shadowed`: for a tombstone, where the deleted entry was (forgotten by the caller).
        """
        st = self._st
        _d, _io, sb = st.dev_io()
        head = st.head
        assert head is not None and head.buffer is not None
        assert head.used + size <= st.config.region_size
        at = head.used
        write_entry(head.buffer.view, at, sb.uuid, seq=head.seq, flags=flags, header=header,
                    payload=payload, size=size)
        head.used = at + size
        if head.durable and head.used - head.durable >= WRITE_CHUNK:
            self._writes.write_behind(head, whole_chunks=True)  # keep the device busy meanwhile
        if flags & TOMBSTONE:
            head.supersedes[key] = at + size
            st.shadow(head, shadowed)
        else:
            st.insert(key, head, offset=at, length=size, meta=meta, hits=hits)

    async def settle_superseded(self) -> None:
        """Tombstone again, in the head, what failed region writes had superseded; under the lock.

        A key stored again since needs no tombstone (its new record is newer than every older
        one): its region inherits the wait instead. A region reused since whose new header is
        still in flight is waited for first: once that header is on media its old records are
        stale, if it fails they are not (`LogState.inherit`). One pass over the items queued when
        it starts (a failure of the region these tombstones go to queues them again, for the
        next pass); an item leaves the queue once done, and a cancellation puts back what is left
        of the one in progress.
        """
        st = self._st
        for _ in range(len(st.superseded)):
            item = st.superseded[0]
            while any(self._header_pending(index, seq) for index, seq in item.regions):
                await st.wait_changed()
            done: set[bytes] = set()
            try:
                for key in sorted(item.keys):
                    loc = st.index.get(key)
                    if loc is not None:
                        st.inherit(st.regions[loc.region], item.regions)
                    else:
                        tomb = ObjectMeta(ValueKind.BYTES, "", (), 0, 0)
                        header = encode_header(ObjectHeader(key, tomb, checksum(b"")))
                        size = entry_size(len(header), 0, st.grain)
                        await self.make_room(size)
                        self.place(key, tomb, header, payload=b"", flags=TOMBSTONE, size=size)
                        assert st.head is not None  # the region the tombstone went to
                        st.inherit(st.head, item.regions)
                    done.add(key)
            except BaseException:
                st.superseded[0] = Superseded(item.keys - done, item.regions)
                raise
            st.superseded.pop(0)

    def _header_pending(self, index: int, seq: int) -> bool:
        region = self._st.regions[index]
        return (region.seq != seq and region.state is not RegionState.FREE
                and not region.header_written and region.failed is None)

    async def _rotate(self, room: int) -> None:
        """Seal the head (write it in the background) and open a new head region with `room`
        bytes free after what a reclaim copies into it."""
        st = self._st
        while st.head is not None:
            if len(st.sealing) < SEALS_IN_FLIGHT:
                self._seal(st.head)
                break
            await st.wait_changed()  # a seal task's end frees a slot (`LogState.sealing`)
        st.reserve.tally(st.regions, st.regions.made)
        keep = st.reserve.needed(st.reserve.bound(st.index))  # with the full head's entries
        region, hot = await self._take_region(keep, room)
        # hot entries left the index with their region: placed whatever befalls the caller (a
        # cancellation while reads of the victim ended dropped them, a flushed object's last
        # durable copy too); a FREE region loses nothing
        opened = self._open_when_ready(region, hot, keep)
        await (outlive_cancel(opened) if hot else opened)

    async def _open_when_ready(self, region: Region, hot: list[HotEntry], keep: int) -> None:
        st = self._st
        await settle(region.writes)  # a region kept FREE may have its empty header going
        while region.readers:  # reads that began before the index let go of the region
            await st.wait_changed()
        self._open_head(region, hot)
        st.reserve.hold(st.index, keep)

    def _seal(self, head: Region) -> None:
        """Detach the head and start writing it, in one step: it is never left without an owner."""
        st = self._st
        st.head = None
        head.state = RegionState.SEALING
        spawn(self._writes.write_sealed(head), st.sealing, st.changed.set)

    async def _take_region(self, keep: int, room: int) -> tuple[Region, list[HotEntry]]:
        """A FREE region for the new head, reclaiming one if need be (also when taking a FREE
        one would leave fewer than `keep`), and the hot entries of a reclaimed victim (out of
        the index: `_open_when_ready` waits for the victim's reads, then places them)."""
        st = self._st
        spare = st.reserve.free
        if not st.reuse_failed:
            # close's last flush: a region whose write failed (perhaps a bad area) is reused
            # only when no victim can be reclaimed (see `_reclaim`), and only healthy regions
            # count as room for the checkpoint that follows
            spare -= sum(1 for r in st.regions
                         if r.state is RegionState.FREE and r.failed is not None)
        free = (st.regions.first_free(lambda r: st.reuse_failed or r.failed is None)
                if spare > keep else None)  # else taking one leaves too few FREE
        region, hot = (free, []) if free is not None else await self._reclaim(room)
        self.in_transit.update((entry.key, entry) for entry in hot)  # no await since the forget
        return region, hot

    def _open_head(self, region: Region, hot: list[HotEntry]) -> None:
        """Make `region` the head and copy `hot` into it; no await."""
        st = self._st
        _d, _io, sb = st.dev_io()
        region.state, region.seq = RegionState.HEAD, st.next_seq
        st.next_seq += 1
        st.reserve.free -= 1
        region.buffer = st.pool.acquire(st.config.region_size, prefault=True)
        write_region_header(region.buffer.view, sb.uuid, region.seq, region.index, st.align)
        # durable 0: nothing issued yet, so `place` writes nothing behind before the header
        region.used, region.durable, region.live, region.synced_to = st.align, 0, 0, 0
        region.failed, region.failed_at, region.header_written = None, None, False
        region.resumed_at, region.supersedes = 0, {}
        region.last_access = st.tick
        st.head = region
        # they fit: they all came from one region of the same geometry
        for entry in hot:
            size = entry_size(len(entry.header), len(entry.payload), st.grain)
            self.place(entry.key, entry.meta, entry.header, payload=entry.payload, flags=0,
                       size=size)
            self.in_transit.pop(entry.key, None)
            st.counters["entries_reinserted"] += 1
        if hot:
            self._writes.pad(region)
        # The new header (new seq) makes the region's old records stale on media, so a crash can
        # never bring back what a reclaim dropped; only once it is written may regions
        # superseding those records be reclaimed in turn. The kept entries go in the same single
        # write (after the header alone, a `kill -9` lost them: their new records were in the
        # buffer). Written in the background, first of the region's writes: awaited here, it
        # held every put for the 10-40 ms the device took behind queue_depth 1 MiB writes.
        waiting = [r for r in st.regions if region.index in r.shadows]
        region.shadows.clear()  # empty already: a victim shadows nothing
        region.durable = region.used
        spawn(self._writes.write_region_header(region, waiting, region.used), region.writes)

    async def _reclaim(self, room: int) -> tuple[Region, list[HotEntry]]:
        """Free a victim region; returns it and the hot entries to copy into the new head, as
        many as leave `room` bytes free there.

        Everything before the victim is freed only waits and reads; freeing it and dropping its
        keys (`LogState.drop`) is one step.
        """
        st = self._st
        # a region still being written may be the oldest (FIFO) or the least recently used
        # one (LRU): wait for it rather than take a younger region out of turn
        await settle(st.sealing)
        while True:
            victims = self._victims()
            if victims:
                break
            # Failed writes can leave every sealed region waiting for a FREE one (a region
            # shadowing a failed region waits for its reuse): reuse it then.
            spare = st.regions.first_free()
            if spare is not None:
                return spare, []
            await st.wait_changed()
        return await self._free_victim(victims, room)

    def _victims(self) -> list[Region]:
        # A region superseding records of an older one waits for it (see Region.shadows);
        # the oldest sealed region never waits, so FIFO is unaffected.
        return [r for r in self._st.regions
                if r.state is RegionState.SEALED and r.readers == 0 and not r.shadows]

    async def _free_victim(self, victims: list[Region], room: int
                           ) -> tuple[Region, list[HotEntry]]:
        """Free one of `victims` (chosen by the eviction policy) and read its hot entries (as
        many as leave `room` bytes of a region free); the awaits (reads) come first, then the
        index lets go of it in one step."""
        st = self._st
        if not st.reuse_failed:  # close's last flush: not into a region whose write failed
            victims = [r for r in victims if r.failed is None] or victims
        victim = choose_victim(st, victims)
        asked: set[bytes] = set()
        hot: list[HotEntry] = []
        while more := entries_to_keep(st, victim, room, asked, hot):
            # what the owner says an entry is worth may change while the reads await (another
            # tier let its copy of an object go, and this one is now its last durable copy):
            # ask again about the rest, until the answers hold across the reads
            asked.update(more)
            hot += await self._read_hot(victim, more)
        # from here on no await: the index lets go of the victim in this step
        keys = st.index.keys_in_region(victim.index)  # a get may have dropped a corrupt one
        held = set(keys)
        hot = [entry for entry in hot if entry.key in held]
        reinserted = {entry.key for entry in hot}
        victim.state = RegionState.FREE
        st.reserve.free += 1
        for key in keys:
            st.forget(key)
        victim.live = 0
        dropped = [key for key in keys if key not in reinserted]
        if dropped:
            st.pending_drops.setdefault(victim.index, set()).update(dropped)
        st.counters["regions_reclaimed"] += 1
        st.counters["entries_dropped"] += len(dropped)
        st.drop(dropped, for_room=True)
        return victim, hot

    async def _restore_reserve(self, keep: int) -> None:
        """Reclaim a victim into FREE, for the checkpoint; under the lock, with a head.

        Its hot entries go into the head where they leave `keep` bytes free (the room a put
        rotated for: taken, a second rotation kept nothing of its victim, the engine's records
        included), the others are dropped; it gets a header of a new, empty use, written in the
        background: its old records are stale on media then, as a reused region's are, and the
        regions shadowing it stop waiting for it. Until it is reused its seq stays the old one
        (reads that began before the reclaim check their entries against it). No sealed region
        eligible (each waits for another): the reservation is `waived` until the next rotation.
        """
        st = self._st
        await settle(st.sealing)  # as `_reclaim`: a region being written may be the victim due
        victims = self._victims()
        if not victims:
            st.reserve.waived = True
            log.info("%s: no region to reclaim for the checkpoint's room", st.name)
            return
        victim, hot = await self._free_victim(victims, 0)
        # no await from here: the victim's hot entries go back into the head in this step
        head, dropped = st.head, []
        for entry in hot:
            size = entry_size(len(entry.header), len(entry.payload), st.grain)
            if head is not None and head.used + size + keep <= st.config.region_size:
                self.place(entry.key, entry.meta, entry.header, payload=entry.payload,
                           flags=0, size=size)
                st.counters["entries_reinserted"] += 1
            else:
                dropped.append(entry.key)
        st.counters["entries_dropped"] += len(dropped)
        st.counters["reserve_reclaims"] += 1
        if dropped:
            st.pending_drops.setdefault(victim.index, set()).update(dropped)
        st.drop(dropped, for_room=True)
        seq, st.next_seq = st.next_seq, st.next_seq + 1
        waiting = [r for r in st.regions if victim.index in r.shadows]
        # the entries kept went into the head's buffer: written out now, and the empty header,
        # which makes their old records stale, only after them (`write_empty`)
        carried = head if head is not None and len(hot) > len(dropped) else None
        if carried is not None:
            self._writes.write_behind(carried)
        spawn(self._writes.write_empty(victim, seq, waiting, after=carried), victim.writes)
        st.reserve.hold(st.index, st.reserve.held)

    async def _read_hot(self, victim: Region, keys: list[bytes]) -> list[HotEntry]:
        st = self._st

        async def one(key: bytes) -> HotEntry | None:
            loc = st.index.get(key)
            if loc is None or loc.region != victim.index:
                return None
            try:
                entry = await self.read_entry(victim, loc)
            except DeviceError:
                return None
            if entry is None:
                return None
            header, header_bytes, payload = entry
            return HotEntry(key, header.meta, header_bytes, bytes(payload))

        # a cancellation cancels these reads (they are this caller's own); each gives its
        # buffer and its count in `readers` back before the cancellation goes on
        results = await asyncio.gather(*(one(k) for k in keys))
        return [r for r in results if r is not None]

    async def read_entry(self, region: Region, loc: Location
                         ) -> tuple[ObjectHeader, bytes, memoryview] | None:
        """Header, its bytes and a payload view of one entry; ``None`` (counted) if corrupt.

        The payload view aliases a private copy, so the caller owns it. From the device, the
        entry's span is rounded out to whole blocks (O_DIRECT) and the entry sliced out of them.
        """
        st = self._st
        _d, io, sb = st.dev_io()
        if region.buffer is not None and loc.offset >= region.resumed_at:
            data = bytearray(region.buffer.view[loc.offset : loc.offset + loc.length])
        else:
            start = loc.offset // st.align * st.align
            length = align_up(loc.offset + loc.length, st.align) - start
            skip = loc.offset - start
            buf = st.pool.acquire(length)
            region.readers += 1
            try:
                # a cancelled read returns once the device is done with `buf` (`BlockIO`)
                await io.read(buf, st.offset(region.index) + start, length)
                data = bytearray(buf.view[skip : skip + loc.length])
            finally:
                region.readers -= 1
                st.pool.release(buf)
                if region.readers == 0:
                    st.changed.set()
            st.counters["bytes_read"] += length
        try:
            return decode_entry(memoryview(data), sb.uuid, region.seq)
        except CorruptObjectError as exc:
            st.counters["checksum_failures"] += 1
            log.warning("%s: entry at region %d offset %d is corrupt: %s", st.name,
                        region.index, loc.offset, exc)
            return None
