"""NvmeTier (L3): a log of fixed-size regions on a file or block device, O_DIRECT, io_uring.

Layout on media: `tierkv.formats.nvme_layout`. Puts append ``prefix | object header (with the
key) | payload`` entries, each aligned to the device's block size and checksummed, into the
in-memory *head* region buffer; a full head is sealed and written whole in the background (at
most two regions in flight) while a fresh head takes new puts. Write-behind: whenever 1 MiB or
more of the head is unwritten, a put starts writing it in the background in whole 1 MiB pieces
aligned on the device (the tail waits for the next put), so large objects go to the device at
once; `flush()` writes the head's unwritten part and waits for every write. Region buffers come
prefaulted on transparent huge pages from the pool and are reused (see `_aligned`).
Reads of entries still in a buffer are served from memory; other reads go to the device through
the IO backend into a pooled aligned buffer and are copied out, so the caller owns what `get`
returns. Deletes append a tombstone entry.

Space: `capacity` is the region area (region count times region size). When no region is free,
puts reclaim a whole *victim* region — oldest first (``eviction = "fifo"``) or least recently read
(``"lru"``) — that no read is using: its entries that were read at least `reinsert_hits` times
since they were written are copied into the head, the rest are dropped and their keys returned
by that `put` (keys dropped by a reclaim inside `delete` are returned by the next `put`). An
entry must fit in one region (`can_ever_hold`); `fits` is therefore true for anything
`can_ever_hold` accepts.

Recovery: a clean `close()` writes an index checkpoint (msgpack, checksummed) into free regions
and records it in the superblock; `open` loads it when valid and at once clears it from the
superblock (so a later crash scans). Otherwise the index is rebuilt by scanning region entry
headers (`_nvme_scan`). Entries failing a checksum are never served: at scan they are dropped,
at `get` the key becomes a miss; both are counted (``checksum_failures``). A crash never brings
back a deleted, overwritten or dropped entry once the delete/overwrite was flushed: a region
holding a record that supersedes one in an older region (an overwrite or a tombstone) is not
reclaimed before that older region (`Region.shadows`; the oldest sealed region is always
eligible, so LRU degrades towards FIFO only under heavy overwriting), and a region taken for
reuse gets its new header written first of its writes (in the background, not holding puts),
which makes its old records stale for the scan; regions superseding those records become
reclaimable only once that write has completed.
When free regions cannot hold the checkpoint at close (or writing it fails), none is recorded
and the next open scans.

Concurrency: every coroutine may run concurrently on one event loop; appends, deletes and
reclaims are serialised by one `asyncio.Lock`, reads are not. Errors: `DeviceError` (with
`errno`) when the device fails an operation; a failed background region write drops that region's
entries (their keys are returned by the next `put`) and `flush()` raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from tierkv._platform import io_uring_available, o_direct_supported
from tierkv.config import NvmeTierConfig, RegionEviction
from tierkv.errors import ConfigError, CorruptObjectError, DeviceError, TierFullError
from tierkv.formats.header import (
    ObjectHeader,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from tierkv.formats.nvme_layout import (
    MAX_CHECKPOINT_REGIONS,
    PREFIX,
    SUPERBLOCK_SIZE,
    TOMBSTONE,
    Checkpoint,
    CheckpointEntry,
    CheckpointRegion,
    ForeignFormatError,
    Superblock,
    align_up,
    checkpoint_total,
    decode_checkpoint,
    decode_prefix,
    decode_superblock,
    encode_checkpoint,
    encode_prefix,
    encode_region_header,
    encode_superblock,
    entry_size,
    format_uuid,
    new_uuid,
)
from tierkv.formats.value import ObjectMeta, Payload, ValueKind, payload_view
from tierkv.tiers._aligned import AlignedBuffer, AlignedPool
from tierkv.tiers._blockio import BlockIO
from tierkv.tiers._nvme_device import Device, make_backend, open_device
from tierkv.tiers._nvme_index import Location, NvmeIndex
from tierkv.tiers._nvme_regions import Region, RegionState
from tierkv.tiers._nvme_scan import read_range, scan_regions
from tierkv.tiers.base import RecoveredObject, Tier, TierKind

log = logging.getLogger(__name__)

#: bytes reserved for the object header when sizing an object before its header exists
HEADER_ALLOWANCE = 256
_SEALS_IN_FLIGHT = 2
_WRITE_CHUNK = 1 << 20


class NvmeTier(Tier):
    """The L3 tier; see the module docstring for layout, space, recovery and concurrency."""

    kind = TierKind.NVME
    persistent = True

    def __init__(self, config: NvmeTierConfig) -> None:
        super().__init__(config.name)
        self.config = config
        if config.region_size % 4096 or config.region_size < (1 << 20):
            raise ConfigError(f"{config.name}.region_size: must be a multiple of 4KiB, >= 1MiB")
        self._region_count = (config.capacity - SUPERBLOCK_SIZE) // config.region_size
        if self._region_count < 1:
            raise ConfigError(
                f"{config.name}.capacity: {config.path} needs room for the superblock and a region"
            )
        self._device: Device | None = None
        self._io: BlockIO | None = None
        self._pool = AlignedPool()
        self._sb: Superblock | None = None
        self._index = NvmeIndex(4096)
        self._regions: list[Region] = []
        self._head: Region | None = None
        self._next_seq = 1
        self._tick = 0
        self._lock = asyncio.Lock()
        self._seal_slots = asyncio.Semaphore(_SEALS_IN_FLIGHT)
        self._sealing: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._lost: list[bytes] = []
        self._write_error: DeviceError | None = None
        self._recovered_from = "new"
        self._live = 0
        self._counters = {"checksum_failures": 0, "bytes_read": 0, "bytes_written": 0,
                          "regions_reclaimed": 0, "entries_reinserted": 0, "entries_dropped": 0,
                          "checkpoint_skipped": 0}

    # -- geometry --------------------------------------------------------------------------------
    @property
    def _align(self) -> int:
        return self._device.alignment if self._device is not None else 4096

    @property
    def capacity(self) -> int:
        return self._region_count * self.config.region_size

    @property
    def used(self) -> int:
        return self._live

    def footprint(self, nbytes: int) -> int:
        return entry_size(HEADER_ALLOWANCE, nbytes, self._align)

    def _max_entry(self) -> int:
        return self.config.region_size - self._align

    def can_ever_hold(self, nbytes: int) -> bool:
        return self.footprint(nbytes) <= self._max_entry()

    def fits(self, nbytes: int) -> bool:
        return self.can_ever_hold(nbytes)

    def _offset(self, region: int) -> int:
        return SUPERBLOCK_SIZE + region * self.config.region_size

    def _dev_io(self) -> tuple[Device, BlockIO, Superblock]:
        assert self._device is not None and self._io is not None and self._sb is not None
        return self._device, self._io, self._sb

    # -- lifecycle -------------------------------------------------------------------------------
    async def _open(self) -> list[RecoveredObject]:
        device = open_device(self.config)
        self._device = device
        self._index = NvmeIndex(device.alignment)
        try:
            self._io = make_backend(self.config, device)
            self._regions = [Region(i) for i in range(self._region_count)]
            await self._load_or_format(device)
        except BaseException:
            await self._release()
            if device.created:
                with contextlib.suppress(OSError):
                    os.unlink(device.path)
            raise
        recovered = []
        for key in list(self._index.keys()):
            meta = self._index.meta(key)
            assert meta is not None
            recovered.append(RecoveredObject(key, meta))
        log.info("%s: opened %s (%s, %s), %d objects recovered from %s", self.name,
                 device.path, self._io.name if self._io else "?",
                 "direct" if device.direct else "buffered", len(recovered), self._recovered_from)
        return recovered

    async def _load_or_format(self, device: Device) -> None:
        io = self._io
        assert io is not None
        need = SUPERBLOCK_SIZE + self._region_count * self.config.region_size
        existing: Superblock | None = None
        if 0 < device.size < SUPERBLOCK_SIZE and not self.config.format:
            raise DeviceError(f"{device.path}: {device.size} bytes of another format (shorter "
                              "than a superblock); set format = true to overwrite it")
        if device.size >= SUPERBLOCK_SIZE and not device.created:
            buf = self._pool.acquire(SUPERBLOCK_SIZE)
            try:
                await io.read(buf, 0, SUPERBLOCK_SIZE)
                existing = decode_superblock(buf.view[:SUPERBLOCK_SIZE])
            except ForeignFormatError as exc:
                if not self._blank(buf.view[:SUPERBLOCK_SIZE]) and not self.config.format:
                    raise DeviceError(
                        f"{device.path}: holds another format ({exc}); set format = true to "
                        "overwrite it"
                    ) from exc
            except CorruptObjectError as exc:
                if not self.config.format:
                    raise DeviceError(f"{device.path}: damaged tierkv superblock: {exc}") from exc
            finally:
                self._pool.release(buf)
        if existing is not None and not self.config.format:
            if (existing.region_size, existing.region_count) != (
                self.config.region_size, self._region_count
            ):
                raise DeviceError(
                    f"{device.path}: formatted with region_size {existing.region_size} x "
                    f"{existing.region_count} regions, the config asks for "
                    f"{self.config.region_size} x {self._region_count}; set format = true to "
                    "reformat"
                )
            self._sb = existing
            await self._recover(existing)
            return
        if device.block_device and device.size < need:
            raise DeviceError(
                f"{device.path}: {device.size} bytes is smaller than the configured {need}"
            )
        await self._format(device, need)

    @staticmethod
    def _blank(view: memoryview) -> bool:
        return not any(view)

    async def _format(self, device: Device, need: int) -> None:
        if not device.block_device:
            try:
                os.ftruncate(device.fd, need)
                os.posix_fallocate(device.fd, 0, need)
            except OSError as exc:
                raise DeviceError(f"{device.path}: cannot size the file to {need} bytes: "
                                  f"{exc.strerror}") from exc
        sb = Superblock(self.config.region_size, self.config.capacity, self._region_count,
                        new_uuid(), device.alignment)
        # A reformatted device may hold regions of the old uuid; they are ignored by the scan.
        self._sb = sb
        await self._write_superblock(sb)
        self._recovered_from = "new"

    async def _write_superblock(self, sb: Superblock) -> None:
        _d, io, _s = self._dev_io()
        buf = self._pool.acquire(SUPERBLOCK_SIZE)
        try:
            buf.view[:SUPERBLOCK_SIZE] = encode_superblock(sb)
            await io.write(buf, 0, SUPERBLOCK_SIZE)
            await io.sync()
        finally:
            self._pool.release(buf)
        self._counters["bytes_written"] += SUPERBLOCK_SIZE

    async def _recover(self, sb: Superblock) -> None:
        if sb.checkpoint_length:
            try:
                await self._load_checkpoint(sb)
            except CorruptObjectError as exc:
                log.warning("%s: checkpoint unusable (%s); scanning regions", self.name, exc)
                self._reset_index()
            else:
                self._recovered_from = "checkpoint"
                self._sb = sb.without_checkpoint()
                await self._write_superblock(self._sb)  # a crash from now on must scan
                return
        await self._scan(sb)
        self._recovered_from = "scan"
        if sb.checkpoint_length:
            self._sb = sb.without_checkpoint()
            await self._write_superblock(self._sb)

    def _reset_index(self) -> None:
        self._index = NvmeIndex(self._align)
        self._regions = [Region(i) for i in range(self._region_count)]
        self._live = 0

    async def _load_checkpoint(self, sb: Superblock) -> None:
        _d, io, _s = self._dev_io()
        size = self.config.region_size
        parts = [await read_range(io, self._pool, self._offset(i), size)
                 for i in sb.checkpoint_regions]
        data = b"".join(parts)
        total, check = checkpoint_total(data)
        if total != sb.checkpoint_length or check != sb.checkpoint_checksum:
            raise CorruptObjectError("checkpoint does not match the superblock")
        ckpt = decode_checkpoint(data, sb.uuid)
        self._next_seq = ckpt.next_seq
        for r in ckpt.regions:
            if r.index >= self._region_count or r.index in sb.checkpoint_regions:
                raise CorruptObjectError("checkpoint names an impossible region")
            region = self._regions[r.index]
            region.state, region.seq, region.used = RegionState.SEALED, r.seq, r.used
            region.last_access = r.last_access
            region.shadows = set(r.shadows)
            self._tick = max(self._tick, r.last_access)
        sealed = {r.index for r in ckpt.regions}
        if any(not self._regions[i].shadows <= sealed for i in sealed):
            raise CorruptObjectError("checkpoint region shadows an impossible region")
        for e in ckpt.entries:
            if e.region >= self._region_count:
                raise CorruptObjectError("checkpoint entry in an impossible region")
            target = self._regions[e.region]
            if target.state is not RegionState.SEALED or e.offset + e.length > target.used \
                    or e.offset % self._align:
                raise CorruptObjectError("checkpoint entry outside its region")
            try:
                kind = ValueKind(e.kind)
            except ValueError as exc:
                raise CorruptObjectError("checkpoint entry of unknown kind") from exc
            meta = ObjectMeta(kind, e.dtype, e.shape, e.nbytes, e.generation, e.parents)
            self._insert(e.key, target, offset=e.offset, length=e.length, meta=meta, hits=e.hits)

    async def _scan(self, sb: Superblock) -> None:
        _d, io, _s = self._dev_io()
        self._reset_index()
        for scanned in await scan_regions(io, self._pool, sb):
            region = self._regions[scanned.index]
            region.state, region.seq, region.used = RegionState.SEALED, scanned.seq, scanned.used
            self._next_seq = max(self._next_seq, scanned.seq + 1)
            self._counters["checksum_failures"] += scanned.corrupt
            for entry in scanned.entries:
                if entry.tombstone:
                    self._shadow(region, self._forget(entry.key))
                else:
                    self._insert(entry.key, region, offset=entry.offset,
                                 length=entry.length, meta=entry.meta, hits=0)
        self._counters["bytes_read"] += sum(r.used for r in self._regions)

    async def _close(self) -> None:
        try:
            try:
                await self._flush()
            except DeviceError as exc:
                log.error("%s: flush at close failed (%s); no checkpoint written", self.name, exc)
            else:
                try:
                    await self._write_checkpoint()
                except DeviceError as exc:
                    # the superblock still names no checkpoint: the next open scans
                    self._counters["checkpoint_skipped"] += 1
                    log.error("%s: writing the checkpoint failed (%s)", self.name, exc)
        finally:
            await self._release()

    async def _release(self) -> None:
        if self._sealing:
            await asyncio.gather(*self._sealing, return_exceptions=True)
        for region in self._regions:  # a head whose flush failed may still have writes out
            if region.writes:
                await asyncio.gather(*list(region.writes), return_exceptions=True)
        for region in self._regions:
            if region.buffer is not None:
                self._pool.release(region.buffer)
                region.buffer = None
        if self._io is not None:
            await self._io.aclose()
            self._io = None
        self._pool.close()
        if self._device is not None:
            os.close(self._device.fd)
            self._device = None

    async def _write_checkpoint(self) -> None:
        _d, io, sb = self._dev_io()
        if self._head is not None:
            self._seal_in_place(self._head)
        regions = [CheckpointRegion(r.index, r.seq, r.used, r.last_access, tuple(sorted(r.shadows)))
                   for r in self._regions if r.state is RegionState.SEALED]
        entries = []
        for key in list(self._index.keys()):
            loc, meta = self._index.get(key), self._index.meta(key)
            assert loc is not None and meta is not None
            entries.append(CheckpointEntry(key, loc.region, loc.offset, loc.length, loc.hits,
                                           int(meta.kind), meta.dtype, meta.shape, meta.nbytes,
                                           meta.generation, meta.parents))
        data = encode_checkpoint(Checkpoint(sb.uuid, self._next_seq, tuple(regions), entries))
        size = self.config.region_size
        needed = -(-len(data) // size)
        free = [r.index for r in self._regions if r.state is RegionState.FREE]
        if needed > len(free) or needed > MAX_CHECKPOINT_REGIONS:
            self._counters["checkpoint_skipped"] += 1
            log.warning("%s: no room for a %d-byte checkpoint; the next open will scan",
                        self.name, len(data))
            return
        targets = tuple(free[:needed])
        buf = self._pool.acquire(size)
        try:
            for n, index in enumerate(targets):
                chunk = data[n * size : (n + 1) * size]
                length = align_up(len(chunk), self._align)
                buf.view[: len(chunk)] = chunk
                buf.view[len(chunk) : length] = bytes(length - len(chunk))
                await io.write(buf, self._offset(index), length)
                self._counters["bytes_written"] += length
        finally:
            self._pool.release(buf)
        await io.sync()
        self._sb = sb.with_checkpoint(len(data), checksum(data[24:]), targets)
        await self._write_superblock(self._sb)

    # -- index helpers ---------------------------------------------------------------------------
    def _insert(self, key: bytes, region: Region, *, offset: int, length: int,
                meta: ObjectMeta, hits: int) -> None:
        old = self._index.put(key, region=region.index, offset=offset, length=length, meta=meta,
                              hits=hits)
        if old is not None:
            self._regions[old.region].live -= old.length
            self._live -= old.length
            self._shadow(region, old)
        region.live += length
        self._live += length

    def _shadow(self, region: Region, old: Location | None) -> None:
        """`region` now holds a record superseding `old` (an overwrite or a tombstone)."""
        if old is not None and old.region != region.index:
            region.shadows.add(old.region)

    def _unshadow(self, gone: Region) -> None:
        """`gone`'s records no longer exist on media: nothing needs to outlive it any more."""
        gone.shadows.clear()
        for region in self._regions:
            region.shadows.discard(gone.index)

    def _forget(self, key: bytes) -> Location | None:
        old = self._index.remove(key)
        if old is not None:
            self._regions[old.region].live -= old.length
            self._live -= old.length
        return old

    # -- data path -------------------------------------------------------------------------------
    async def put(self, key: bytes, meta: ObjectMeta, payload: Payload) -> Sequence[bytes]:
        self._check_open()
        view = payload_view(payload)
        if not self.can_ever_hold(view.nbytes):
            raise TierFullError(f"{self.name}: {view.nbytes} bytes do not fit in one region")
        if meta.nbytes != view.nbytes:
            raise ValueError(f"meta says {meta.nbytes} bytes, the payload has {view.nbytes}")
        header = encode_header(ObjectHeader(key, meta, checksum(view)))
        size = entry_size(len(header), view.nbytes, self._align)
        if size > self._max_entry():
            raise TierFullError(f"{self.name}: an entry of {size} bytes does not fit a region")
        async with self._lock:
            dropped = await self._append(key, meta, header, payload=view, flags=0, size=size)
            if self._lost:
                dropped.extend(self._lost)
                self._lost.clear()
        # a reclaim may have dropped this key's previous entry; the key itself is stored
        return [k for k in dropped if k != key]

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
        if head.used - head.durable >= _WRITE_CHUNK:
            self._write_behind(head, whole_chunks=True)  # keep the device busy meanwhile
        if flags & TOMBSTONE:
            # the region of the deleted entry may have been reclaimed by the rotation above
            if shadowed is not None and self._regions[shadowed[0].region].seq == shadowed[1]:
                self._shadow(head, shadowed[0])
        else:
            self._insert(key, head, offset=at, length=size, meta=meta, hits=hits)
        return dropped

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
        free = next((r for r in self._regions if r.state is RegionState.FREE), None)
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
        if self.config.eviction is RegionEviction.LRU and self._sealing:
            # a region still being written may be the least recently used one
            await asyncio.gather(*self._sealing, return_exceptions=True)
        while True:
            # A region superseding records of an older one waits for it (see Region.shadows);
            # the oldest sealed region never waits, so FIFO is unaffected.
            victims = [r for r in self._regions
                       if r.state is RegionState.SEALED and r.readers == 0 and not r.shadows]
            if victims:
                break
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

    async def _write_region_header(self, region: Region, waiting: list[Region]) -> None:
        """Write `region`'s new header; then `waiting` no longer wait for its old records."""
        try:
            await self._write_buffer(region, 0, self._align, urgent=True)
        except DeviceError as exc:
            if region.failed is None:
                region.failed = exc  # the old header stands: `waiting` keep waiting
            return
        region.header_written = True
        for other in waiting:
            other.shadows.discard(region.index)
        self._changed.set()

    async def _write_sealed(self, region: Region) -> None:
        try:
            await self._drain_writes(region)
        except DeviceError as exc:
            log.error("%s: writing region %d failed: %s", self.name, region.index, exc)
            self._write_error = exc
            lost = self._index.keys_in_region(region.index)
            for key in lost:
                self._forget(key)
            self._lost.extend(lost)
            region.state = RegionState.FREE
            if region.header_written:  # else its old records may still be on media
                self._unshadow(region)
        else:
            region.state = RegionState.SEALED
        finally:
            if region.buffer is not None:
                self._pool.release(region.buffer)
                region.buffer = None
            self._seal_slots.release()
            self._changed.set()

    async def _write_buffer(self, region: Region, start: int, end: int, *,
                            urgent: bool = False) -> None:
        _d, io, _sb = self._dev_io()
        assert region.buffer is not None
        buffer: AlignedBuffer = region.buffer
        base = self._offset(region.index)
        # split at device offsets that are multiples of the chunk, as fio's 1 MiB blocks are
        cuts = [start, *range((base + start) // _WRITE_CHUNK * _WRITE_CHUNK + _WRITE_CHUNK - base,
                              end, _WRITE_CHUNK), end]
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
            end = (base + end) // _WRITE_CHUNK * _WRITE_CHUNK - base
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
        self._head = None

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

    async def get(self, key: bytes) -> tuple[ObjectMeta, Payload] | None:
        self._check_open()
        loc = self._index.get(key)
        if loc is None:
            return None
        region = self._regions[loc.region]
        self._index.touch(key)
        self._tick += 1
        region.last_access = self._tick
        entry = await self._read_entry(region, loc)
        if entry is None or entry[0].key != key:
            current = self._index.get(key)
            if current is not None and (current.region, current.offset) == (loc.region, loc.offset):
                self._forget(key)
            if entry is not None:
                self._counters["checksum_failures"] += 1
            return None
        header, _raw, payload = entry
        return header.meta, payload

    async def delete(self, key: bytes) -> bool:
        self._check_open()
        async with self._lock:
            meta = self._index.meta(key)
            if meta is None:
                return False
            tomb = ObjectMeta(ValueKind.BYTES, "", (), 0, meta.generation)
            header = encode_header(ObjectHeader(key, tomb, checksum(b"")))
            size = entry_size(len(header), 0, self._align)
            old = self._forget(key)
            assert old is not None
            shadowed = (old, self._regions[old.region].seq)
            self._lost.extend(await self._append(key, tomb, header, payload=b"",
                                                flags=TOMBSTONE, size=size, shadowed=shadowed))
        return True

    async def contains(self, key: bytes) -> bool:
        self._check_open()
        return key in self._index

    def keys(self) -> Iterator[bytes]:
        return self._index.keys()

    async def flush(self) -> None:
        self._check_open()
        await self._flush()

    async def _flush(self) -> None:
        async with self._lock:
            if self._sealing:
                await asyncio.gather(*self._sealing, return_exceptions=True)
            _d, io, _sb = self._dev_io()
            head = self._head
            if head is not None:
                await self._drain_writes(head)
            await io.sync()
            error, self._write_error = self._write_error, None
        if error is not None:
            raise error

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        data = super().stats()
        states = [r.state for r in self._regions]
        data.update(self._counters)
        data.update({
            "backend": self._io.name if self._io is not None else None,
            "regions_used": sum(s is not RegionState.FREE for s in states),
            "regions_free": sum(s is RegionState.FREE for s in states),
            "entries": len(self._index),
            "recovered_from": self._recovered_from,
        })
        return data

    def describe(self) -> dict[str, str]:
        device = self._device
        info = {
            "path": str(self.config.path),
            "capacity": str(self.capacity),
            "region_size": str(self.config.region_size),
            "regions": str(self._region_count),
            "eviction": self.config.eviction.value,
        }
        if device is None:
            info["state"] = self.state.value
            return info
        info.update({
            "device": "block device" if device.block_device else "regular file",
            "io": "direct (O_DIRECT)" if device.direct else "buffered (page cache)",
            "backend": self._io.name if self._io is not None else "closed",
            "logical_block_size": (str(device.logical_block_size)
                                   if device.logical_block_size else "unknown (4096 assumed)"),
            "alignment": str(device.alignment),
            "queue_depth": str(self.config.queue_depth),
        })
        if self._sb is not None:
            info["uuid"] = format_uuid(self._sb.uuid)
        return info


def probe(config: NvmeTierConfig) -> dict[str, str]:
    """What this machine offers the tier at `config.path`, without touching the tier's file.

    O_DIRECT is tried on a temporary file beside the path (or read-only on a block device).
    """
    reason = io_uring_available()
    return {
        "io_uring": "available" if reason is None else f"unavailable: {reason}",
        "o_direct": ("supported" if o_direct_supported(config.path)
                     else "refused (use direct = false)"),
        "backend": config.backend.value,
        "path_exists": "yes" if config.path.exists() else "no (created at open)",
    }
