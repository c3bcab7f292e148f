"""L2: a libpmemobj pool on a DAX device or file; one atomic allocation per object.

Write path: `put` makes one ``pmemobj_xalloc`` of the record (prefix, header, payload;
`formats.pmem_layout`) whose constructor fills it and persists it once, as a whole, before PMDK
publishes the allocation, so after a crash an object is either whole or absent. The payload is
hashed and streamed in chunks (`_copy_in`: memory is read once, with non-temporal stores); the
header, which holds the checksum, is written after it at an offset sized for the widest checksum
encoding (the payload moves up in the 1-in-2**32 case of a shorter one). An overwrite allocates
the new record first and frees the old one after; a crash in between leaves both, and recovery
keeps the newer. `delete` is ``pmemobj_free`` (atomic).

Recovery: `open` walks every object of the pool (``pmemobj_first``/``pmemobj_next``), checks each
record's prefix, header and payload checksum, frees what fails (counted), keeps the newest record
of each key and rebuilds the DRAM index (key → object). Objects beyond the configured capacity
(a pool reopened with a smaller one) are freed oldest first.

Space: objects are allocated from the tier's own allocation classes; `footprint` is the object's
whole allocation unit, so `used` is the pool space objects really take and never exceeds
`capacity`. `put` raises `TierFullError` when the object does not fit the capacity *or* when PMDK
reports the pool full (fragmentation); the engine then evicts and retries.

Media: `open` reports whether the mapping is real persistent memory (libpmem's ``pmem_is_pmem``).
On an ordinary file PMDK persists with msync and the tier says it is *emulated*; on tmpfs the pool
survives a process crash but not a reboot. `describe` and `stats` state which case holds.

Concurrency: coroutines of one event loop. Copies of payloads of `LARGE_COPY` bytes or more (in
and out of the pool) and the recovery walk run on the tier's copy thread (`_CopyThreads`: ctypes
and xxhash release the GIL); small ones run inline. The index and `used` are touched only on the
loop: a copy's bookkeeping runs there when it ends, even if its caller was cancelled meanwhile (a
cancelled put then frees what it wrote; a cancelled get releases its hold). A `get` that
overlaps a `delete` or overwrite of its key holds the old allocation until its copy is done
(reader count), so it returns the whole old object, never reused memory.

Buffers: `put` copies the payload before it returns; `get` returns a writable `memoryview` of a
fresh (not zero-filled) numpy buffer that the caller owns.

Errors: `DeviceError` for a pool that is not ours (another layout, a corrupt header, a non-pool
file: the file is left untouched unless ``format = true``), a pool another process holds ("in
use"), or a failing PMDK call (with ``pmemobj_errormsg``); `TierFullError` as above.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import functools
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import xxhash

from tierkv.config import PmemTierConfig
from tierkv.errors import CorruptObjectError, DeviceError, TierFullError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.header import ObjectHeader, encode_header, verify_payload
from tierkv.formats.value import ObjectMeta, Payload, payload_view
from tierkv.tiers import _pmemobj as pmemobj
from tierkv.tiers.base import RecoveredObject, Tier, TierKind

log = logging.getLogger(__name__)

T = TypeVar("T")

#: payloads of this many bytes or more are copied on the worker thread, off the event loop
LARGE_COPY = 64 << 10
#: threads that run large copies (and the recovery walk). On the 2-vCPU test VM two threads
#: were no faster than one with 8 requests in flight, and gets were slower (three threads
#: contending for the GIL and two cores; docs/benchmarks-pmem.md)
COPY_THREADS = 1
#: copy-and-hash granule: the chunk just copied is still in L2 (1 MiB per core on the test VM)
#: when hashed. 256 KiB chunks were ~8 % slower for 4 MiB objects (more Python per chunk) and
#: whole-object calls no faster than 1 MiB ones (docs/benchmarks-pmem.md)
CHUNK = 1 << 20
#: record bytes besides the payload that `footprint(nbytes)` assumes (prefix + a typical header)
HEADER_ALLOWANCE = 256
_MAX_CHECKSUM = 2**64 - 1


@dataclass(slots=True, eq=False)
class _Object:
    """One live record: where it is and what it holds; `readers` > 0 defers its free."""

    oid: pmemobj.Oid
    address: int
    meta: ObjectMeta
    payload_offset: int
    payload_checksum: int
    footprint: int
    sequence: int
    readers: int = 0
    doomed: bool = False


@dataclass(frozen=True, slots=True)
class Media:
    """What the pool is mapped on, and what that means for durability."""

    is_pmem: bool
    filesystem: str
    tmpfs: bool

    @property
    def emulated(self) -> bool:
        return not self.is_pmem

    @property
    def durability(self) -> str:
        if self.is_pmem:
            return ("real persistent memory: an object is durable once put returns (CPU cache "
                    "flushes), across process crashes and power loss where the platform "
                    "flushes its caches on power failure (ADR/eADR)")
        if self.tmpfs:
            return ("emulated on tmpfs (RAM): the pool survives a process crash, NOT a reboot "
                    "or power loss")
        return (f"emulated on an ordinary {self.filesystem} file: persisted by msync (slow); "
                "survives a process crash; power-loss safety is only what msync writeback "
                "of this filesystem gives, not persistent memory")


def filesystem_of(path: Path) -> tuple[str, str]:
    """(type, mount options) of the mount holding `path` (or its nearest existing ancestor)."""
    target = path
    while not target.exists():
        target = target.parent
    resolved = os.path.realpath(target)
    best_point, fstype, options = "", "unknown", ""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return fstype, options
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or not tail:
            continue
        point = fields[4].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best_point):
            best_point, fstype = point, tail[0]
            options = fields[5] + ("," + tail[2] if len(tail) > 2 else "")
    return fstype, options


def _is_dax(fstype: str, options: str, path: Path) -> bool:
    if path.exists() and not path.is_file() and path.name.startswith("dax"):
        return True
    return any(opt in ("dax", "dax=always") for opt in options.split(","))


def _address_of(view: memoryview) -> int:
    """The address of a contiguous host buffer, read-only ones included."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def _pool_view(address: int, size: int) -> memoryview:
    """A view of pool memory; the caller drops it before the object is freed or the pool closed."""
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


def _copy_in(pool: pmemobj.Pool, dest: int, view: memoryview) -> int:
    """Copy `nbytes` into the pool; the xxh3 of the bytes copied.

    Chunk by chunk (one chunk for objects up to `CHUNK`), the source is hashed and then streamed
    into the pool from the cache the hash just filled, so the source is read from memory once and
    no destination line is read at all (streaming stores). Each hash and copy is one C call that
    releases the GIL. The caller persists the record. A caller that changes its buffer during the
    put (against the contract) gets a checksum miss on get, never wrong bytes.
    """
    nbytes = view.nbytes
    if not nbytes:
        return xxhash.xxh3_64_intdigest(b"")
    source = _address_of(view)
    if nbytes <= CHUNK:
        payload_sum = xxhash.xxh3_64_intdigest(view)
        pool.stream(dest, source, nbytes)
    else:
        digest = xxhash.xxh3_64()
        for start in range(0, nbytes, CHUNK):
            length = min(CHUNK, nbytes - start)
            digest.update(view[start : start + length])
            pool.stream(dest + start, source + start, length)
        payload_sum = digest.intdigest()
    pool.drain()
    return payload_sum


def _copy_out(obj: _Object) -> memoryview | None:
    """A caller-owned copy of the payload (uninitialised buffer, filled and hashed chunk by
    chunk, one chunk for objects up to `CHUNK`); ``None`` when it fails its checksum."""
    nbytes = obj.meta.nbytes
    out = np.empty(nbytes, dtype=np.uint8)
    view = out.data
    source = obj.address + obj.payload_offset
    target = int(out.ctypes.data)
    if nbytes <= CHUNK:
        ctypes.memmove(target, source, nbytes)
        payload_sum = xxhash.xxh3_64_intdigest(view)
    else:
        digest = xxhash.xxh3_64()
        for start in range(0, nbytes, CHUNK):
            length = min(CHUNK, nbytes - start)
            ctypes.memmove(target + start, source + start, length)
            digest.update(view[start : start + length])
        payload_sum = digest.intdigest()
    return view if payload_sum == obj.payload_checksum else None


#: what runs on the loop when a job ends: (result, error, abandoned: its caller was cancelled)
Finish = Callable[[Any, BaseException | None, bool], None]


@dataclass(frozen=True, slots=True)
class _Job(Generic[T]):
    work: Callable[[], T]
    future: asyncio.Future[T]
    finish: Finish | None


class _CopyThreads:
    """Threads that run pool copies off the event loop (ctypes and xxhash release the GIL).

    Jobs go in through one `queue.SimpleQueue`; a thread that finds more jobs queued takes the
    next without sleeping. Results come back through `loop.call_soon_threadsafe`, but at most one
    such wake-up is pending at a time: results that finish meanwhile ride along with it.
    A job's `finish` runs on the loop when the job ends, before its future is resolved and
    whether or not the caller still waits (a cancelled caller cancels only its future): that is
    where the tier does its bookkeeping. `close` waits for every job submitted.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int, name: str) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._results: deque[tuple[_Job[Any], Any, BaseException | None]] = deque()
        self._lock = threading.Lock()
        self._posted = False
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, work: Callable[[], T], finish: Finish | None = None) -> asyncio.Future[T]:
        future: asyncio.Future[T] = self._loop.create_future()
        self._in_flight += 1
        self._drained.clear()
        self._jobs.put(_Job(work, future, finish))
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                result, error = job.work(), None
            except BaseException as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            self._results.append((job, result, error))
            with self._lock:
                post, self._posted = not self._posted, True
            if post:
                self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            self._posted = False
        while self._results:
            job, result, error = self._results.popleft()
            self._in_flight -= 1
            future = job.future
            try:
                if job.finish is not None:
                    job.finish(result, error, future.cancelled())
            except BaseException as exc:  # a bookkeeping failure goes to the caller
                error = exc
            if future.cancelled():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        if not self._in_flight:
            self._drained.set()

    async def close(self) -> None:
        await self._drained.wait()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()  # each is past its last job: this returns at once


class PmemTier(Tier):
    """The L2 persistent-memory tier (see the module docstring)."""

    kind = TierKind.PMEM
    persistent = True

    def __init__(self, config: PmemTierConfig) -> None:
        super().__init__(config.name)
        self.config = config
        self.path = config.path
        self._capacity = config.capacity
        self._pool: pmemobj.Pool | None = None
        self._objects: dict[bytes, _Object] = {}
        self._used = 0
        self._payload_bytes = 0
        self._sequence = 1
        self._class_flags: list[int] = []
        self._arena = 0
        self._copy_threads: _CopyThreads | None = None
        self._operations = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.media: Media | None = None
        self._counters = {
            "corrupt_freed_at_open": 0,
            "superseded_freed_at_open": 0,
            "over_capacity_freed_at_open": 0,
            "checksum_misses": 0,
            "pool_full": 0,
        }

    # -- lifecycle -------------------------------------------------------------------------------
    async def _open(self) -> list[RecoveredObject]:
        loop = asyncio.get_running_loop()
        copier = _CopyThreads(loop, COPY_THREADS, f"tierkv-{self.name}-pmem")
        try:
            recovered = await copier.submit(self._open_sync)
        except BaseException:
            await copier.close()
            raise
        self._copy_threads = copier
        return recovered

    async def _close(self) -> None:
        await self._idle.wait()
        if self._copy_threads is not None:
            await self._copy_threads.close()
            self._copy_threads = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._objects.clear()

    def _open_sync(self) -> list[RecoveredObject]:
        pool = self._open_pool()
        try:
            self._check_root(pool)
            self._register_classes(pool)
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
            recovered = self._recover(pool)
        except BaseException:
            self._pool = None
            pool.close()
            raise
        log.info("tier %s: pool %s (%d bytes, %s), %d objects recovered, %d corrupt freed",
                 self.name, self.path, pool.size, self.media.durability, len(recovered),
                 self._counters["corrupt_freed_at_open"])
        if self.media.emulated:
            log.warning("tier %s: %s is not persistent memory: %s", self.name, self.path,
                        self.media.durability)
        return recovered

    def _open_pool(self) -> pmemobj.Pool:
        # pay the pool's page faults at open, not in the middle of puts and gets
        pmemobj.set_prefault(at_create=False, at_open=True)
        found = layout.inspect_pool(self.path)
        kind = found.kind
        if kind is layout.PoolFile.ABSENT:
            return self._create_file()
        if kind in (layout.PoolFile.TIERKV, layout.PoolFile.DEVICE):
            try:
                return pmemobj.open_pool(self.path, layout.LAYOUT_NAME)
            except DeviceError as exc:
                if pmemobj.failure_errno(exc) in pmemobj.IN_USE_ERRNOS:
                    raise DeviceError(f"{self.path}: pmem pool is in use by another process "
                                      "(or already open)") from exc
                if not self.config.format:
                    raise DeviceError(f"{self.path}: cannot open the pmem pool ({exc}); set "
                                      "format = true to recreate it, losing its contents") from exc
                log.warning("tier %s: recreating unreadable pool %s (%s)", self.name,
                            self.path, exc)
                return self._recreate(kind)
        what = f"{kind.value} {found.layout!r}" if found.layout else kind.value
        if not self.config.format:
            raise DeviceError(f"{self.path}: {what}, not a tierkv pool; refusing to overwrite "
                              "it (set format = true to replace it)")
        log.warning("tier %s: replacing %s at %s (format = true)", self.name, what, self.path)
        return self._recreate(kind)

    def _recreate(self, kind: layout.PoolFile) -> pmemobj.Pool:
        if kind is layout.PoolFile.DEVICE:
            return pmemobj.create_pool(self.path, layout.LAYOUT_NAME, 0)
        # PMDK holds an flock on an open pool: never unlink a file somebody still uses
        with self.path.open("rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                raise DeviceError(f"{self.path}: in use by another process") from exc
            return self._create_file()

    def _create_file(self) -> pmemobj.Pool:
        # Built under a temporary name and renamed into place once whole, so that a crash
        # during creation never leaves a half-made pool at the configured path (which a later
        # open would refuse as "not a pool"). A leftover temporary is our own: remove it.
        temporary = self.path.with_name(self.path.name + ".creating")
        temporary.unlink(missing_ok=True)
        pool = pmemobj.create_pool(temporary, layout.LAYOUT_NAME,
                                   layout.pool_size_for(self._capacity))
        try:
            self._check_root(pool)
        finally:
            pool.close()
        os.replace(temporary, self.path)
        return pmemobj.open_pool(self.path, layout.LAYOUT_NAME)

    def _check_root(self, pool: pmemobj.Pool) -> None:
        address = pool.direct(pool.root(layout.ROOT_SIZE))
        raw = ctypes.string_at(address, layout.ROOT_SIZE)
        try:
            valid = layout.check_root(raw)
        except CorruptObjectError as exc:
            raise DeviceError(f"{self.path}: {exc}") from exc
        if not valid:
            pool.memcpy_persist(address, layout.encode_root(), layout.ROOT_SIZE)

    def _register_classes(self, pool: pmemobj.Pool) -> None:
        # one arena for every allocation: each arena holds a partly used run per class, and the
        # pool is sized for one run per class (formats/pmem_layout.py)
        arena = pmemobj.arena_flag(1) if pool.arena_count() >= 1 else 0
        self._class_flags = [
            pmemobj.class_flag(pool.register_class(cls.unit, cls.units_per_run)) | arena
            for cls in layout.SIZE_CLASSES
        ]

    def _recover(self, pool: pmemobj.Pool) -> list[RecoveredObject]:
        found: dict[bytes, _Object] = {}
        oid = pool.first()
        while oid is not None:
            following = pool.next(oid)
            record = self._check_record(pool, oid)
            if record is None:
                self._counters["corrupt_freed_at_open"] += 1
                pool.free(oid)
            else:
                key, obj = record
                old = found.get(key)
                if old is not None:
                    if (old.meta.generation, old.sequence) > (obj.meta.generation, obj.sequence):
                        old, obj = obj, old
                    self._counters["superseded_freed_at_open"] += 1
                    pool.free(old.oid)
                found[key] = obj
            oid = following
        total = sum(obj.footprint for obj in found.values())
        for key, obj in sorted(found.items(), key=lambda item: item[1].sequence):
            if total <= self._capacity:
                break
            pool.free(obj.oid)
            total -= obj.footprint
            del found[key]
            self._counters["over_capacity_freed_at_open"] += 1
        self._objects = found
        self._used = total
        self._payload_bytes = sum(obj.meta.nbytes for obj in found.values())
        self._sequence = max((obj.sequence for obj in found.values()), default=0) + 1
        return [RecoveredObject(key, obj.meta) for key, obj in found.items()]

    def _check_record(self, pool: pmemobj.Pool, oid: pmemobj.Oid) -> tuple[bytes, _Object] | None:
        if pool.type_num(oid) != layout.OBJECT_TYPE_NUM:
            log.warning("tier %s: freeing an object of unknown type %#x", self.name,
                        pool.type_num(oid))
            return None
        usable = pool.usable_size(oid)
        address = pool.direct(oid)
        view = _pool_view(address, usable)
        try:
            info = layout.decode_record(view)
            header = info.header
            verify_payload(header, view[info.payload_offset : info.record_size])
        except CorruptObjectError as exc:
            log.warning("tier %s: freeing a corrupt object at offset %#x: %s", self.name,
                        oid.off, exc)
            return None
        finally:
            view.release()
        obj = _Object(oid, address, header.meta, info.payload_offset, header.payload_checksum,
                      usable + layout.ALLOC_HEADER, info.sequence)
        return header.key, obj

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
        # the widest header (a checksum of 2**32 or more: all but 1 in 2**32) sizes the record
        widest = encode_header(ObjectHeader(key, meta, _MAX_CHECKSUM))
        reserved = layout.record_footprint(layout.PREFIX_SIZE + len(widest) + view.nbytes)
        self._reserve(reserved)
        if view.nbytes < LARGE_COPY:
            try:
                obj = self._write(sequence, key, meta, view, len(widest))
            except BaseException as exc:
                self._used -= reserved
                self._count_failure(exc)
                raise
            self._used += obj.footprint - reserved
            self._install(key, obj)
            return ()
        def finish(obj: _Object | None, error: BaseException | None, abandoned: bool) -> None:
            # on the loop, once the worker is done, whether or not the caller still waits
            self._end()
            if obj is None:
                self._used -= reserved
                self._count_failure(error)
                return
            self._used += obj.footprint - reserved
            if abandoned:  # a cancelled put leaves nothing behind
                self._release(obj)
            else:
                self._install(key, obj)

        self._begin()
        await self._copier().submit(
            functools.partial(self._write, sequence, key, meta, view, len(widest)), finish)
        return ()

    def _count_failure(self, error: BaseException | None) -> None:
        if isinstance(error, TierFullError):
            self._counters["pool_full"] += 1

    def _write(self, sequence: int, key: bytes, meta: ObjectMeta, view: memoryview,
               header_guess: int) -> _Object:
        """Allocate and fill one record; runs inline (small) or on a copy thread (large).

        The payload is copied and hashed in `CHUNK`s (hashing the chunk just written, still in
        the cache), so memory is read about once; the header, which holds the checksum, is
        written after it, and the whole record is persisted once before PMDK publishes it.
        """
        pool = self._live_pool()
        prefix = layout.encode_prefix(sequence)
        offset = len(prefix) + header_guess
        nbytes = view.nbytes
        written: list[int] = []

        def construct(address: int) -> None:
            payload_sum = _copy_in(pool, address + offset, view)
            record = prefix + encode_header(ObjectHeader(key, meta, payload_sum))
            if len(record) != offset:  # a shorter checksum encoding: the payload moves up
                ctypes.memmove(address + len(record), address + offset, nbytes)
            ctypes.memmove(address, record, len(record))
            pool.persist(address, len(record) + nbytes)
            written.extend((payload_sum, len(record), address))

        size = offset + nbytes
        cls = layout.size_class(size)
        flags = self._class_flags[layout.SIZE_CLASSES.index(cls)] if cls is not None else 0
        try:
            oid = pool.alloc(size, layout.OBJECT_TYPE_NUM, construct, flags)
        except DeviceError as exc:
            if pmemobj.failure_errno(exc) == errno.ENOMEM:
                raise TierFullError(f"tier {self.name!r}: pool {self.path} has no room for "
                                    f"{size} bytes") from exc
            raise
        payload_sum, payload_offset, address = written
        return _Object(oid, address, meta, payload_offset, payload_sum,
                       pool.usable_size(oid) + layout.ALLOC_HEADER, sequence)

    def _install(self, key: bytes, obj: _Object) -> None:
        old = self._objects.get(key)
        if old is not None and old.sequence > obj.sequence:
            self._release(obj)  # a later put of this key finished first
            return
        self._objects[key] = obj
        self._payload_bytes += obj.meta.nbytes
        if old is not None:
            self._payload_bytes -= old.meta.nbytes
            self._release(old)

    def _release(self, obj: _Object) -> None:
        if obj.readers:
            obj.doomed = True
            return
        self._live_pool().free(obj.oid)
        self._used -= obj.footprint

    def _live_pool(self) -> pmemobj.Pool:
        if self._pool is None:
            raise DeviceError(f"tier {self.name!r}: pool {self.path} is not open")
        return self._pool

    def _begin(self) -> None:
        self._operations += 1
        self._idle.clear()

    def _end(self) -> None:
        self._operations -= 1
        if not self._operations:
            self._idle.set()

    async def get(self, key: bytes) -> tuple[ObjectMeta, Payload] | None:
        self._check_open()
        obj = self._objects.get(key)
        if obj is None:
            return None
        obj.readers += 1
        self._begin()

        def finish(_data: object = None, _error: object = None, _abandoned: bool = False) -> None:
            # the allocation stays ours until the copy is done, even if the caller went away
            obj.readers -= 1
            if obj.doomed and not obj.readers:
                obj.doomed = False
                self._release(obj)
            self._end()

        if obj.meta.nbytes < LARGE_COPY:
            try:
                data = _copy_out(obj)
            finally:
                finish()
        else:
            data = await self._copier().submit(functools.partial(_copy_out, obj), finish)
        if data is None:
            self._counters["checksum_misses"] += 1
            log.warning("tier %s: checksum mismatch, dropping the object", self.name)
            if self._objects.get(key) is obj:
                del self._objects[key]
                self._payload_bytes -= obj.meta.nbytes
                self._release(obj)
            return None
        return obj.meta, data

    def _copier(self) -> _CopyThreads:
        assert self._copy_threads is not None  # set for the whole time the tier is open
        return self._copy_threads

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
        }


def probe(config: PmemTierConfig) -> dict[str, str]:
    """What `tierkv info` can say about a pmem tier without creating or touching its pool."""
    info: dict[str, str] = {"path": str(config.path)}
    try:
        pmemobj.library()
        info["library"] = f"{pmemobj.LIBPMEMOBJ} and {pmemobj.LIBPMEM} loaded"
    except DeviceError as exc:
        info["library"] = str(exc)
    found = layout.inspect_pool(config.path)
    if found.kind is layout.PoolFile.ABSENT:
        info["pool"] = (f"absent; open creates {layout.pool_size_for(config.capacity)} bytes "
                        f"for capacity {config.capacity}")
    else:
        info["pool"] = f"{found.kind.value}" + (f", {found.size} bytes" if found.size else "")
    fstype, options = filesystem_of(config.path)
    dax = _is_dax(fstype, options, config.path)
    info["filesystem"] = fstype + (" mounted with dax" if dax else "")
    if fstype == "tmpfs":
        info["mapping"] = ("emulated (tmpfs is RAM, not persistent memory): survives a process "
                           "crash, not a reboot")
    elif dax:
        info["mapping"] = "DAX: real persistent memory is confirmed by pmem_is_pmem at open"
    else:
        info["mapping"] = (f"emulated ({fstype} without DAX, persisted by msync); "
                           "pmem_is_pmem is known only once the pool is open")
    return info
