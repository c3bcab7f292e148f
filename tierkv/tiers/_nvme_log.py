"""The NVMe tier's append log: entries into the head, rotation, region reclaim and reinsertion.

Separate from the tier's public surface because it is the space policy mechanism of the log:
which region a reclaim takes (`eviction`, `Region.shadows`), which of its entries are copied back
(`reinsert_hits`), and reading an entry back (shared with `get`). Appends, rotations and reclaims
run under the tier's lock; reads do not.
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
from tierkv.tiers._nvme_index import Location
from tierkv.tiers._nvme_regions import Region, RegionState
from tierkv.tiers._nvme_state import log
from tierkv.tiers._nvme_writes import WRITE_CHUNK, RegionWrites


class RegionLog(RegionWrites):
    """Appending to the head region and recycling regions; see `tierkv.tiers.nvme`."""

    async def _append(self, key: bytes, meta: ObjectMeta, header: bytes, *,
                      payload: memoryview | bytes, flags: int, size: int,
                      hits: int = 0, shadowed: tuple[Location, int] | None = None
                      ) -> list[bytes]:
        """Copy one entry into the head (rotating first if it does not fit); under `_lock`."""
        dropped: list[bytes] = []
        while self._head is None or self._head.used + size > self.config.region_size:
            dropped.extend(await self._rotate())
        _d, _io, sb = self._dev_io()
        head = self._head
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
            self._write_behind(head, whole_chunks=True)  # keep the device busy meanwhile
        if flags & TOMBSTONE:
            head.supersedes.add(key)
            # the region of the deleted entry may have been reclaimed by the rotation above
            if shadowed is not None and self._regions[shadowed[0].region].seq == shadowed[1]:
                self._shadow(head, shadowed[0])
        else:
            self._insert(key, head, offset=at, length=size, meta=meta, hits=hits)
        return dropped

    async def _settle_superseded(self) -> None:
        """Tombstone again, in the head, what failed region writes had superseded; under `_lock`.

        A key stored again since needs no tombstone (its new record is newer than every older
        one): its region inherits the wait instead. A region reused since whose new header is
        still in flight is waited for first: once that header is on media its old records are
        stale, if it fails they are not (`_inherit`). Keys a reclaim drops here are returned by
        the next `put`. A failure of the region these tombstones go to queues them again.
        """
        batch, self._superseded = self._superseded, []
        for item in batch:
            while any(self._header_pending(index, seq) for index, seq in item.regions):
                self._changed.clear()
                await self._changed.wait()
            for key in sorted(item.keys):
                loc = self._index.get(key)
                if loc is not None:
                    self._inherit(self._regions[loc.region], item.regions)
                    continue
                tomb = ObjectMeta(ValueKind.BYTES, "", (), 0, 0)
                header = encode_header(ObjectHeader(key, tomb, checksum(b"")))
                size = entry_size(len(header), 0, self._align)
                self._lost.extend(await self._append(key, tomb, header, payload=b"",
                                                     flags=TOMBSTONE, size=size))
                assert self._head is not None  # the region the tombstone went to
                self._inherit(self._head, item.regions)

    def _header_pending(self, index: int, seq: int) -> bool:
        region = self._regions[index]
        return (region.seq != seq and region.state is not RegionState.FREE
                and not region.header_written and region.failed is None)

    async def _rotate(self) -> list[bytes]:
        """Seal the head (write it in the background) and open a new head region."""
        if self._head is not None:
            head, self._head = self._head, None
            await self._seal_slots.acquire()
            head.state = RegionState.SEALING
            task = asyncio.create_task(self._write_sealed(head))
            self._sealing.add(task)
            task.add_done_callback(self._sealing.discard)
        dropped: list[bytes] = []
        hot: list[tuple[bytes, ObjectMeta, bytes, bytes]] = []
        # `_reuse_failed` is False for close's last flush: a region whose write failed (perhaps a
        # bad area) is then reused only when no victim can be reclaimed (see `_reclaim`)
        free = next((r for r in self._regions if r.state is RegionState.FREE
                     and (self._reuse_failed or r.failed is None)), None)
        if free is None:
            region, hot, dropped = await self._reclaim()
        else:
            region = free
        _d, _io, sb = self._dev_io()
        region.state, region.seq = RegionState.HEAD, self._next_seq
        self._next_seq += 1
        region.buffer = self._pool.acquire(self.config.region_size, prefault=True)
        region.buffer.view[: self._align] = encode_region_header(
            sb.uuid, region.seq, region.index
        ).ljust(self._align, b"\0")
        region.used, region.durable, region.live = self._align, self._align, 0
        region.failed, region.header_written = None, False
        region.supersedes = set()
        # The new header (new seq) makes the region's old records stale on media, so a crash can
        # never bring back what a reclaim dropped; only once it is written may regions
        # superseding those records be reclaimed in turn. It is written in the background, first
        # of the region's writes: awaiting it here held every put for the 10-40 ms the device
        # took to serve it behind queue_depth 1 MiB writes, and left the device idle after.
        waiting = [r for r in self._regions if region.index in r.shadows]
        region.shadows.clear()  # empty already: a victim shadows nothing
        task = asyncio.create_task(self._write_region_header(region, waiting))
        region.writes.add(task)
        task.add_done_callback(region.writes.discard)
        region.last_access = self._tick
        self._head = region
        for key, meta, header, payload in hot:
            size = entry_size(len(header), len(payload), self._align)
            dropped.extend(await self._append(key, meta, header, payload=payload, flags=0,
                                              size=size))
            self._counters["entries_reinserted"] += 1
        return dropped

    async def _reclaim(self) -> tuple[Region, list[tuple[bytes, ObjectMeta, bytes, bytes]],
                                      list[bytes]]:
        """Free a victim region; returns it, the hot entries to reinsert and the dropped keys."""
        if self._sealing:
            # a region still being written may be the oldest (FIFO) or the least recently used
            # one (LRU): wait for it rather than take a younger region out of turn
            await asyncio.gather(*self._sealing, return_exceptions=True)
        while True:
            # A region superseding records of an older one waits for it (see Region.shadows);
            # the oldest sealed region never waits, so FIFO is unaffected.
            victims = [r for r in self._regions
                       if r.state is RegionState.SEALED and r.readers == 0 and not r.shadows]
            if victims:
                break
            # Failed writes can leave every sealed region waiting for a FREE one (a region
            # shadowing a failed region waits for its reuse): reuse it then.
            spare = next((r for r in self._regions if r.state is RegionState.FREE), None)
            if spare is not None:
                return spare, [], []
            self._changed.clear()
            await self._changed.wait()
        if self.config.eviction is RegionEviction.LRU:
            victim = min(victims, key=lambda r: (r.last_access, r.seq))
        else:
            victim = min(victims, key=lambda r: r.seq)
        victim.state = RegionState.FREE  # no new reads start on it; the index still points at it
        keys = self._index.keys_in_region(victim.index)
        threshold = self.config.reinsert_hits
        hot_keys = []
        for key in keys:
            loc = self._index.get(key)
            if threshold and loc is not None and loc.hits >= threshold:
                hot_keys.append(key)
        hot: list[tuple[bytes, ObjectMeta, bytes, bytes]] = []
        if hot_keys:
            hot = await self._read_hot(victim, hot_keys)
        for key in keys:
            loc = self._index.get(key)
            if loc is not None and loc.region == victim.index:
                self._forget(key)
        reinserted = {key for key, _m, _h, _p in hot}
        dropped = [key for key in keys if key not in reinserted]
        self._counters["regions_reclaimed"] += 1
        self._counters["entries_dropped"] += len(dropped)
        victim.live = 0
        while victim.readers:  # reads that began before the index let go of the region
            self._changed.clear()
            await self._changed.wait()
        return victim, hot, dropped

    async def _read_hot(self, victim: Region, keys: list[bytes]
                        ) -> list[tuple[bytes, ObjectMeta, bytes, bytes]]:
        async def one(key: bytes) -> tuple[bytes, ObjectMeta, bytes, bytes] | None:
            loc = self._index.get(key)
            if loc is None or loc.region != victim.index:
                return None
            try:
                entry = await self._read_entry(victim, loc)
            except DeviceError:
                return None
            if entry is None:
                return None
            header, header_bytes, payload = entry
            return key, header.meta, header_bytes, bytes(payload)

        results = await asyncio.gather(*(one(k) for k in keys))
        return [r for r in results if r is not None]

    async def _read_entry(self, region: Region, loc: Location
                          ) -> tuple[ObjectHeader, bytes, memoryview] | None:
        """Header, its bytes and a payload view of one entry; ``None`` (counted) if corrupt.

        The payload view aliases a private copy, so the caller owns it.
        """
        _d, io, sb = self._dev_io()
        if region.buffer is not None:
            data = bytearray(region.buffer.view[loc.offset : loc.offset + loc.length])
        else:
            buf = self._pool.acquire(loc.length)
            region.readers += 1
            try:
                await io.read(buf, self._offset(region.index) + loc.offset, loc.length)
                data = bytearray(buf.view[: loc.length])
            finally:
                region.readers -= 1
                self._pool.release(buf)
                if region.readers == 0:
                    self._changed.set()
            self._counters["bytes_read"] += loc.length
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
            self._counters["checksum_failures"] += 1
            log.warning("%s: entry at region %d offset %d is corrupt: %s", self.name,
                        region.index, loc.offset, exc)
            return None
        return header, bytes(view[PREFIX.size:start]), payload

