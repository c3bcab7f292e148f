"""The NVMe tier's append log: entries into the head, rotation, region reclaim and reinsertion.

Separate from the tier's public surface because it is the space policy mechanism of the log:
which region a reclaim takes (`eviction`, `Region.shadows`), which of its entries are copied back
(`reinsert_hits`), and reading an entry back (shared with `get`). `RegionLog` holds the tier's
`LogState` and the write-behind (`RegionWrites`) it seals regions with. Appends, rotations and
reclaims run under the state's lock; reads do not.
"""

from __future__ import annotations

import asyncio

from tierkv.config import RegionEviction
from tierkv.errors import CorruptObjectError, DeviceError
from tierkv.formats.header import (
    ObjectHeader,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from tierkv.formats.nvme_layout import (
    PREFIX,
    TOMBSTONE,
    decode_prefix,
    encode_prefix,
    encode_region_header,
    entry_size,
)
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.nvme._index import Location
from tierkv.tiers.nvme._regions import Region, RegionState
from tierkv.tiers.nvme._state import LogState, log
from tierkv.tiers.nvme._writes import WRITE_CHUNK, RegionWrites


class RegionLog:
    """Appending to the head region and recycling regions; see `tierkv.tiers.nvme.tier`."""

    __slots__ = ("_st", "_writes")

    def __init__(self, state: LogState, writes: RegionWrites) -> None:
        self._st = state
        self._writes = writes

    async def append(self, key: bytes, meta: ObjectMeta, header: bytes, *,
                     payload: memoryview | bytes, flags: int, size: int,
                     hits: int = 0, shadowed: tuple[Location, int] | None = None
                     ) -> list[bytes]:
        """Copy one entry into the head (rotating first if it does not fit); under the lock."""
        st = self._st
        dropped: list[bytes] = []
        while st.head is None or st.head.used + size > st.config.region_size:
            dropped.extend(await self._rotate())
        _d, _io, sb = st.dev_io()
        head = st.head
        assert head.buffer is not None
        view = head.buffer.view
        at = head.used
        body = len(header) + len(payload)
        view[at : at + PREFIX.size] = encode_prefix(sb.uuid, flags, head.seq, body)
        start = at + PREFIX.size
        view[start : start + len(header)] = header
        start += len(header)
        view[start : start + len(payload)] = payload
        start += len(payload)
        view[start : at + size] = bytes(at + size - start)
        head.used = at + size
        if head.used - head.durable >= WRITE_CHUNK:
            self._writes.write_behind(head, whole_chunks=True)  # keep the device busy meanwhile
        if flags & TOMBSTONE:
            head.supersedes.add(key)
            # the region of the deleted entry may have been reclaimed by the rotation above
            if shadowed is not None and st.regions[shadowed[0].region].seq == shadowed[1]:
                st.shadow(head, shadowed[0])
        else:
            st.insert(key, head, offset=at, length=size, meta=meta, hits=hits)
        return dropped

    async def settle_superseded(self) -> None:
        """Tombstone again, in the head, what failed region writes had superseded; under the lock.

        A key stored again since needs no tombstone (its new record is newer than every older
        one): its region inherits the wait instead. A region reused since whose new header is
        still in flight is waited for first: once that header is on media its old records are
        stale, if it fails they are not (`LogState.inherit`). Keys a reclaim drops here are
        returned by the next `put`. A failure of the region these tombstones go to queues them
        again.
        """
        st = self._st
        batch, st.superseded = st.superseded, []
        for item in batch:
            while any(self._header_pending(index, seq) for index, seq in item.regions):
                st.changed.clear()
                await st.changed.wait()
            for key in sorted(item.keys):
                loc = st.index.get(key)
                if loc is not None:
                    st.inherit(st.regions[loc.region], item.regions)
                    continue
                tomb = ObjectMeta(ValueKind.BYTES, "", (), 0, 0)
                header = encode_header(ObjectHeader(key, tomb, checksum(b"")))
                size = entry_size(len(header), 0, st.align)
                st.lost.extend(await self.append(key, tomb, header, payload=b"",
                                                 flags=TOMBSTONE, size=size))
                assert st.head is not None  # the region the tombstone went to
                st.inherit(st.head, item.regions)

    def _header_pending(self, index: int, seq: int) -> bool:
        region = self._st.regions[index]
        return (region.seq != seq and region.state is not RegionState.FREE
                and not region.header_written and region.failed is None)

    async def _rotate(self) -> list[bytes]:
        """Seal the head (write it in the background) and open a new head region."""
        st = self._st
        if st.head is not None:
            head, st.head = st.head, None
            await st.seal_slots.acquire()
            head.state = RegionState.SEALING
            task = asyncio.create_task(self._writes.write_sealed(head))
            st.sealing.add(task)
            task.add_done_callback(st.sealing.discard)
        dropped: list[bytes] = []
        hot: list[tuple[bytes, ObjectMeta, bytes, bytes]] = []
        # `reuse_failed` is False for close's last flush: a region whose write failed (perhaps a
        # bad area) is then reused only when no victim can be reclaimed (see `_reclaim`)
        free = next((r for r in st.regions if r.state is RegionState.FREE
                     and (st.reuse_failed or r.failed is None)), None)
        if free is None:
            region, hot, dropped = await self._reclaim()
        else:
            region = free
        _d, _io, sb = st.dev_io()
        region.state, region.seq = RegionState.HEAD, st.next_seq
        st.next_seq += 1
        region.buffer = st.pool.acquire(st.config.region_size, prefault=True)
        region.buffer.view[: st.align] = encode_region_header(
            sb.uuid, region.seq, region.index
        ).ljust(st.align, b"\0")
        region.used, region.durable, region.live = st.align, st.align, 0
        region.failed, region.header_written = None, False
        region.supersedes = set()
        # The new header (new seq) makes the region's old records stale on media, so a crash can
        # never bring back what a reclaim dropped; only once it is written may regions
        # superseding those records be reclaimed in turn. It is written in the background, first
        # of the region's writes: awaiting it here held every put for the 10-40 ms the device
        # took to serve it behind queue_depth 1 MiB writes, and left the device idle after.
        waiting = [r for r in st.regions if region.index in r.shadows]
        region.shadows.clear()  # empty already: a victim shadows nothing
        task = asyncio.create_task(self._writes.write_region_header(region, waiting))
        region.writes.add(task)
        task.add_done_callback(region.writes.discard)
        region.last_access = st.tick
        st.head = region
        for key, meta, header, payload in hot:
            size = entry_size(len(header), len(payload), st.align)
            dropped.extend(await self.append(key, meta, header, payload=payload, flags=0,
                                             size=size))
            st.counters["entries_reinserted"] += 1
        return dropped

    async def _reclaim(self) -> tuple[Region, list[tuple[bytes, ObjectMeta, bytes, bytes]],
                                      list[bytes]]:
        """Free a victim region; returns it, the hot entries to reinsert and the dropped keys."""
        st = self._st
        if st.sealing:
            # a region still being written may be the oldest (FIFO) or the least recently used
            # one (LRU): wait for it rather than take a younger region out of turn
            await asyncio.gather(*st.sealing, return_exceptions=True)
        while True:
            # A region superseding records of an older one waits for it (see Region.shadows);
            # the oldest sealed region never waits, so FIFO is unaffected.
            victims = [r for r in st.regions
                       if r.state is RegionState.SEALED and r.readers == 0 and not r.shadows]
            if victims:
                break
            # Failed writes can leave every sealed region waiting for a FREE one (a region
            # shadowing a failed region waits for its reuse): reuse it then.
            spare = next((r for r in st.regions if r.state is RegionState.FREE), None)
            if spare is not None:
                return spare, [], []
            st.changed.clear()
            await st.changed.wait()
        if st.config.eviction is RegionEviction.LRU:
            victim = min(victims, key=lambda r: (r.last_access, r.seq))
        else:
            victim = min(victims, key=lambda r: r.seq)
        victim.state = RegionState.FREE  # no new reads start on it; the index still points at it
        keys = st.index.keys_in_region(victim.index)
        threshold = st.config.reinsert_hits
        hot_keys = []
        for key in keys:
            loc = st.index.get(key)
            if threshold and loc is not None and loc.hits >= threshold:
                hot_keys.append(key)
        hot: list[tuple[bytes, ObjectMeta, bytes, bytes]] = []
        if hot_keys:
            hot = await self._read_hot(victim, hot_keys)
        for key in keys:
            loc = st.index.get(key)
            if loc is not None and loc.region == victim.index:
                st.forget(key)
        reinserted = {key for key, _m, _h, _p in hot}
        dropped = [key for key in keys if key not in reinserted]
        st.counters["regions_reclaimed"] += 1
        st.counters["entries_dropped"] += len(dropped)
        victim.live = 0
        while victim.readers:  # reads that began before the index let go of the region
            st.changed.clear()
            await st.changed.wait()
        return victim, hot, dropped

    async def _read_hot(self, victim: Region, keys: list[bytes]
                        ) -> list[tuple[bytes, ObjectMeta, bytes, bytes]]:
        st = self._st

        async def one(key: bytes) -> tuple[bytes, ObjectMeta, bytes, bytes] | None:
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
            return key, header.meta, header_bytes, bytes(payload)

        results = await asyncio.gather(*(one(k) for k in keys))
        return [r for r in results if r is not None]

    async def read_entry(self, region: Region, loc: Location
                         ) -> tuple[ObjectHeader, bytes, memoryview] | None:
        """Header, its bytes and a payload view of one entry; ``None`` (counted) if corrupt.

        The payload view aliases a private copy, so the caller owns it.
        """
        st = self._st
        _d, io, sb = st.dev_io()
        if region.buffer is not None:
            data = bytearray(region.buffer.view[loc.offset : loc.offset + loc.length])
        else:
            buf = st.pool.acquire(loc.length)
            region.readers += 1
            try:
                await io.read(buf, st.offset(region.index) + loc.offset, loc.length)
                data = bytearray(buf.view[: loc.length])
            finally:
                region.readers -= 1
                st.pool.release(buf)
                if region.readers == 0:
                    st.changed.set()
            st.counters["bytes_read"] += loc.length
        view = memoryview(data)
        try:
            prefix = decode_prefix(view, 0, sb.uuid)
            if prefix is None or prefix.seq != region.seq or prefix.flags & TOMBSTONE:
                raise CorruptObjectError("entry prefix damaged")
            header, header_len = decode_header(view[PREFIX.size : PREFIX.size + prefix.body_len])
            start = PREFIX.size + header_len
            payload = view[start : start + header.payload_length]
            verify_payload(header, payload)
        except CorruptObjectError as exc:
            st.counters["checksum_failures"] += 1
            log.warning("%s: entry at region %d offset %d is corrupt: %s", st.name,
                        region.index, loc.offset, exc)
            return None
        return header, bytes(view[PREFIX.size:start]), payload
