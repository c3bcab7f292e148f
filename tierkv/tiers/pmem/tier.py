"""L2: a libpmemobj pool on a DAX device or file; one atomic allocation per object.

Write path: `put` makes one ``pmemobj_xalloc`` of the record (prefix, header, payload;
`formats.pmem_layout`) whose constructor fills it and persists it once, as a whole, before PMDK
publishes the allocation, so after a crash an object is either whole or absent (`_records`: the
native library's C constructor where it is built, else a Python one; same bytes). An overwrite
allocates the new record first and frees the old one after; a crash in between leaves both, and
recovery keeps the newer. `delete` is ``pmemobj_free`` (atomic).

Recovery: `open` walks every object of the pool (``pmemobj_first``/``pmemobj_next``), checks each
record's prefix, header and payload checksum, frees what fails (counted; a damaged record whose
header still names its key is reported, `damaged_at_open`, and the key's older record is not
served in its place), keeps the newest record of each key and rebuilds the DRAM index
(key → object), oldest first. Objects beyond the
configured capacity (a pool reopened with a smaller one) are kept: `used` then exceeds
`capacity` until they leave, and no put fits meanwhile; the engine's evictor, cued at open,
moves the oldest out into the tier below (freed here, they were lost even where the log below
had room).

Space: objects are allocated from the tier's own allocation classes; `footprint` is the object's
whole allocation unit, so `used` is the pool space objects really take, and no put takes it
beyond `capacity`. `put` raises `TierFullError` when the object does not fit the capacity *or*
when PMDK reports the pool full (fragmentation); the engine then evicts and retries.

Media: `open` reports whether the mapping is real persistent memory (libpmem's ``pmem_is_pmem``).
On an ordinary file PMDK persists with msync and the tier says it is *emulated*; on tmpfs the pool
survives a process crash but not a reboot. `describe` and `stats` state which case holds.

Concurrency: coroutines of one event loop. Puts and gets of payloads of `LARGE_COPY` bytes or
more never copy on the loop (`_lanes`): with the native library they run on its `NATIVE_WORKERS`
threads, wholly in C and without the GIL (`_queue.NativeQueue`, completions reaped through an
eventfd); without it on the tier's Python copy thread (`_copythreads.CopyThreads`: ctypes and
xxhash release the GIL), which also runs the recovery walk (`_pool`) in both cases. Small
payloads are copied inline. At most `queue_depth` large copies are in flight on either queue
(`_copythreads.JobSlots`); the rest wait for a slot, which the queue gives back when a copy
ends, and a waiting get holds no result buffer yet. The index and `used` are touched only on
the loop: a copy's bookkeeping runs there when it ends, even if its caller was cancelled
meanwhile (a cancelled put then frees what it wrote; a cancelled get releases its hold; one
cancelled while it waited for a slot ends there, having copied nothing). `stats` reports the
copies in flight, waiting, and the most ever in flight (`copies_in_flight_max`). A `get` that
overlaps a `delete` or overwrite of its key holds the old allocation until its copy is done
(reader count), so it returns the whole old object, never reused memory.

Buffers: `put` copies the payload before it returns (a cancelled put's copy may still be
reading it; the tier keeps it referenced until then); `get` returns what the caller owns: for a
bytes value the `bytes` object itself, copied into straight from the pool (`_buffers.fresh_bytes`:
one copy, not one into a buffer and another into `bytes`); for a tensor a writable `memoryview`
of a numpy buffer, not zero-filled, from `_buffers.BufferRecycler` for results of 64 KiB or more
(its memory is reused only once nothing refers to the result any more).

Format: new media (no file, an empty file, a device whose header area is zero) gets a new pool
whatever ``format`` says; media that holds no usable tierkv pool (another file, a zero-filled
one, another layout, a damaged pool header or root) is replaced only with ``format = true`` and
otherwise refused, nothing of it overwritten; a valid pool is opened with its objects either
way, never wiped (`_pool.open_pool`). The deliberate wipe is `tierkv format` (`_pool.wipe`).

At open, damaged media must not take the process down. Before PMDK sees a file its first page is
recognised (`formats.pmem_layout.inspect_pool`: signature, layout name). PMDK itself checks at
open the pool header and descriptor (checksums, versions, sizes) and the heap (its header's
checksum, the zone and chunk headers); what it trusts unchecked (the lanes' undo and redo logs,
whose ``next`` offsets it follows at open; the heap metadata the recovery walk reads) is
exercised first in a probe process (`_probe`) that opens the pool, reads its root and walks
every object, checking that each lies inside the pool and after the one before. Only if the
probe ends well is the pool opened here. A pool PMDK refuses, or whose probe dies by a signal,
strays outside the pool or goes silent for `_probe.STALL` seconds, is damaged: refused or
replaced as above. The probe adds about 30 ms to an open, plus 2 µs per object (measured in
`_probe`). The records themselves are checked by tierkv's own checksums at open (prefix, header,
payload), as before.

Errors: `DeviceError` naming the path for media refused as above, a pool another process holds
("in use"), or a failing PMDK call (with ``pmemobj_errormsg``); `TierFullError` as above.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from tierkv.config import PmemTierConfig, TierKind
from tierkv.errors import DeviceError, TierFullError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.value import ObjectMeta, Payload, payload_view
from tierkv.tiers.base import RecoveredObject, Tier
from tierkv.tiers.pmem import _pmemobj as pmemobj
from tierkv.tiers.pmem._copy import CHUNK
from tierkv.tiers.pmem._lanes import COPY_THREADS, LARGE_COPY, CopyLanes
from tierkv.tiers.pmem._media import Media, filesystem_of, probe
from tierkv.tiers.pmem._pool import PoolObject, open_pool, recover, register_classes
from tierkv.tiers.pmem._records import RecordWriter

# CHUNK, COPY_THREADS, LARGE_COPY and probe live with what they describe; the tier's public
# surface keeps them
__all__ = ["CHUNK", "COPY_THREADS", "HEADER_ALLOWANCE", "LARGE_COPY", "PmemTier", "probe"]

log = logging.getLogger(__name__)

#: record bytes besides the payload that `footprint(nbytes)` assumes (prefix + a typical header)
HEADER_ALLOWANCE = layout.HEADER_ALLOWANCE


class PmemTier(Tier):
    """The L2 persistent-memory tier (see the module docstring)."""

    kind = TierKind.PMEM
    persistent = True

    def __init__(self, config: PmemTierConfig, *, native: bool = True) -> None:
        """`native`: use the native copy paths when they are built (`_native`); False keeps
        the Python ones (tests cover both)."""
        super().__init__(config.name)
        self.queue_depth = config.queue_depth
        self._lanes = CopyLanes(config.name, config.queue_depth, use_native=native)
        self.config = config
        self.path = config.path
        self._capacity = config.capacity
        self._pool: pmemobj.Pool | None = None
        self._objects: dict[bytes, PoolObject] = {}
        self._used = 0
        self._payload_bytes = 0
        self._sequence = 1
        self._writer: RecordWriter | None = None
        self._damaged: frozenset[bytes] = frozenset()
        self.media: Media | None = None
        self._counters = {
            "corrupt_freed_at_open": 0,
            "superseded_freed_at_open": 0,
            "over_capacity_at_open": 0,
            "checksum_misses": 0,
            "pool_full": 0,
        }

    # -- lifecycle -------------------------------------------------------------------------------
    async def _open(self) -> list[RecoveredObject]:
        try:
            return await self._lanes.start(self._open_sync)
        except BaseException:
            # cancelled (a caller's startup timeout): the walk ran on in its thread to its end
            # (`start` waits for it) and may have opened the pool; a tier that never became
            # OPEN is never closed, so the pool stayed held and every later open of it in this
            # process was refused as in use
            await self._close()
            raise

    async def _close(self) -> None:
        await self._lanes.close()
        self._writer = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._objects.clear()

    def _open_sync(self) -> list[RecoveredObject]:
        pool = open_pool(self.config, self.name, self._capacity)
        try:
            class_flags = register_classes(pool)
            native = self._lanes.load_native()
            fstype, _options = filesystem_of(self.path)
            self.media = Media(pool.is_pmem(), fstype, fstype == "tmpfs")
            if pool.size:
                limit = layout.capacity_for(pool.size)
                if limit < self._capacity:
                    log.warning("tier %s: pool %s of %d bytes holds only %d of the configured "
                                "capacity %d", self.name, self.path, pool.size, limit,
                                self._capacity)
                    self._capacity = limit
            self._pool = pool
            self._writer = RecordWriter(pool, class_flags, native, self.name)
            recovered = self._recover(pool)
        except BaseException:
            self._pool = None
            self._writer = None
            pool.close()
            raise
        log.info("tier %s: pool %s (%d bytes, %s), %d objects recovered, %d corrupt freed",
                 self.name, self.path, pool.size, self.media.durability, len(recovered),
                 self._counters["corrupt_freed_at_open"])
        if self.media.emulated:
            log.warning("tier %s: %s is not persistent memory: %s", self.name, self.path,
                        self.media.durability)
        return recovered

    def damaged_at_open(self) -> frozenset[bytes]:
        return self._damaged

    def _recover(self, pool: pmemobj.Pool) -> list[RecoveredObject]:
        walked = recover(pool, self.name, self._counters)
        found = walked.objects
        self._objects = found
        self._damaged = walked.damaged
        self._used = sum(obj.footprint for obj in found.values())
        if self._used > self._capacity:
            self._counters["over_capacity_at_open"] = self._used - self._capacity
            log.warning("tier %s: holds %d bytes, more than its capacity %d (a smaller one than "
                        "before): the oldest objects leave as they are moved out", self.name,
                        self._used, self._capacity)
        self._payload_bytes = sum(obj.meta.nbytes for obj in found.values())
        self._sequence = max((obj.sequence for obj in found.values()), default=0) + 1
        return [RecoveredObject(key, obj.meta) for key, obj in found.items()]

    # -- space -----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    def footprint(self, nbytes: int) -> int:
        """The allocation an object of `nbytes` takes with a typical header (`HEADER_ALLOWANCE`).

        An object whose header is larger (long key, many parents) may take the next class up;
        `used` always counts the real allocation.
        """
        return layout.record_footprint(HEADER_ALLOWANCE + nbytes)

    def can_ever_hold(self, nbytes: int) -> bool:
        size = HEADER_ALLOWANCE + nbytes
        return size <= pmemobj.MAX_ALLOC_SIZE and self.footprint(nbytes) <= self.capacity

    def _reserve(self, footprint: int) -> None:
        if footprint > self._capacity:
            raise TierFullError(f"tier {self.name!r}: an object of {footprint} bytes exceeds "
                                f"the capacity {self._capacity}")
        if self._used + footprint > self._capacity:
            raise TierFullError(f"tier {self.name!r}: {footprint} bytes do not fit "
                                f"({self._used} of {self._capacity} used)")
        self._used += footprint

    # -- data path -------------------------------------------------------------------------------
    async def put(self, key: bytes, meta: ObjectMeta, payload: Payload) -> Sequence[bytes]:
        self._check_open()
        view = payload_view(payload)
        if view.nbytes != meta.nbytes:
            raise ValueError(f"payload holds {view.nbytes} bytes, meta says {meta.nbytes}")
        sequence = self._sequence
        self._sequence += 1
        writer = self._live_writer()
        prepared = writer.prepare(sequence, key, meta, view)
        reserved = layout.record_footprint(prepared.record_size)
        self._reserve(reserved)
        if view.nbytes < LARGE_COPY:
            try:
                obj = prepared.write()
            except BaseException as exc:
                self._used -= reserved
                self._count_failure(exc)
                raise
            self._used += obj.footprint - reserved
            self._install(key, obj)
            return ()

        def finish(obj: PoolObject | None, error: BaseException | None, abandoned: bool) -> None:
            # on the loop, once the worker is done, whether or not the caller still waits
            self._lanes.end()
            if obj is None:
                self._used -= reserved
                self._count_failure(error)
                return
            self._used += obj.footprint - reserved
            if abandoned:  # a cancelled put leaves nothing behind
                self._release(obj)
            else:
                self._install(key, obj)

        self._lanes.begin()
        await self._lanes.write(prepared, writer, meta, sequence, finish)
        return ()

    def _count_failure(self, error: BaseException | None) -> None:
        full = isinstance(error, TierFullError) or (
            isinstance(error, DeviceError) and pmemobj.failure_errno(error) == errno.ENOMEM)
        if full:
            self._counters["pool_full"] += 1

    def _install(self, key: bytes, obj: PoolObject) -> None:
        old = self._objects.get(key)
        if old is not None and old.sequence > obj.sequence:
            self._release(obj)  # a later put of this key finished first
            return
        self._objects[key] = obj
        self._payload_bytes += obj.meta.nbytes
        if old is not None:
            self._payload_bytes -= old.meta.nbytes
            self._release(old)

    def _release(self, obj: PoolObject) -> None:
        if obj.readers:
            obj.doomed = True
            return
        self._live_pool().free(obj.oid)
        self._used -= obj.footprint

    def _live_pool(self) -> pmemobj.Pool:
        if self._pool is None:
            raise DeviceError(f"tier {self.name!r}: pool {self.path} is not open")
        return self._pool

    def _live_writer(self) -> RecordWriter:
        if self._writer is None:
            raise DeviceError(f"tier {self.name!r}: pool {self.path} is not open")
        return self._writer

    async def get(self, key: bytes) -> tuple[ObjectMeta, Payload] | None:
        self._check_open()
        obj = self._objects.get(key)
        if obj is None:
            return None
        obj.readers += 1
        self._lanes.begin()

        def finish(_data: object = None, _error: object = None, _abandoned: bool = False) -> None:
            # the allocation stays ours until the copy is done, even if the caller went away
            obj.readers -= 1
            if obj.doomed and not obj.readers:
                obj.doomed = False
                self._release(obj)
            self._lanes.end()

        data = await self._lanes.read(obj, finish)
        if data is None:
            self._counters["checksum_misses"] += 1
            log.warning("tier %s: checksum mismatch, dropping the object", self.name)
            if self._objects.get(key) is obj:
                del self._objects[key]
                self._payload_bytes -= obj.meta.nbytes
                self._release(obj)
            return None
        return obj.meta, data

    async def delete(self, key: bytes) -> bool:
        self._check_open()
        obj = self._objects.pop(key, None)
        if obj is None:
            return False
        self._payload_bytes -= obj.meta.nbytes
        self._release(obj)
        return True

    async def contains(self, key: bytes) -> bool:
        self._check_open()
        return key in self._objects

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._objects))

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        media = self.media
        stats.update(
            path=str(self.path),
            pool_size=self._pool.size if self._pool is not None else 0,
            is_pmem=media.is_pmem if media else None,
            emulated=media.emulated if media else None,
            tmpfs=media.tmpfs if media else None,
            durability=media.durability if media else "unknown until open",
            **self._lanes.stats(),
            objects=len(self._objects),
            bytes=self._payload_bytes,
            **self._counters,
        )
        return stats

    def describe(self) -> dict[str, str]:
        if self.media is None or self._pool is None:
            return probe(self.config)
        media = self.media
        return {
            "path": str(self.path),
            "pool size": f"{self._pool.size} bytes (capacity {self._capacity})",
            "mapping": "real persistent memory (pmem_is_pmem)" if media.is_pmem
            else "emulated: not persistent memory (pmem_is_pmem = 0)",
            "filesystem": media.filesystem + (" (RAM)" if media.tmpfs else ""),
            "durability": media.durability,
            "copies": self._lanes.copy_path(),
        }
