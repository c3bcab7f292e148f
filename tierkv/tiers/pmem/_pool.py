"""Opening a pmem tier's libpmemobj pool (creating, recreating or refusing it) and recovering it.

Separate from the tier because it is the open-time half of it: it runs once, on the copy thread,
before the tier serves anything; it decides what the media at the configured path may become
(`open_pool`: the one meaning of ``format``; `tierkv format` is `tiers.registry.wipe_all`) and
walks the pool to find the live records (`PoolObject`) that the tier then indexes. An existing
pool is opened and walked in a probe process first (`_probe`), so that damage PMDK does not
check cannot crash this one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierkv._untracked import untrack
from tierkv.config import PmemTierConfig
from tierkv.errors import CorruptObjectError, DeviceError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.header import verify_payload
from tierkv.formats.value import ObjectMeta
from tierkv.tiers._wipe import wipe_media
from tierkv.tiers.pmem import _pmemobj as pmemobj
from tierkv.tiers.pmem import _probe
from tierkv.tiers.pmem._copy import pool_view

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class PoolObject:
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

    def __post_init__(self) -> None:
        untrack(self)  # atoms only: no cycle can pass through it (`tierkv._untracked`)


class _Unusable(Exception):
    """The media holds no usable tierkv pool: what ``format = true`` may overwrite."""


def open_pool(config: PmemTierConfig, name: str, capacity: int) -> pmemobj.Pool:
    """The pool at `config.path`, open, with its root record checked. `name` is the tier's, for
    logs.

    One rule, whatever the media (`format` never wipes a valid pool; `tierkv format` does):

    - new media gets a new pool for `capacity`, whatever ``format`` says: nothing at the path,
      an empty file, a device whose header area is zero;
    - media that holds no usable tierkv pool (another file, a zero-filled one, another layout,
      a pool PMDK finds invalid, one so damaged that opening it crashes or hangs PMDK, shown
      in a probe process (`_probe`), a root record not ours) is replaced with
      ``format = true``; without it it is refused (`DeviceError` naming the path) and none of
      it is overwritten (PMDK's open may update its own run-time state in a pool it opens);
    - a valid pool is opened, with its objects, whatever ``format`` says.

    A pool another process holds is `DeviceError` ("in use") in every case; so is a failure
    that does not show the pool unusable (permissions, I/O): such a pool is never replaced.
    A pool file (not a device) whose mode lets its group or others in is opened with a warning.
    """
    pool = _open_or_create(config, name, capacity)
    _warn_if_open_to_others(config.path, name)
    return pool


def _warn_if_open_to_others(path: Path, name: str) -> None:
    # checked once the pool is open: a file replaced on the way is new (0600), and a device's
    # mode is its administrator's (udev), not something this tier made
    try:
        info = os.stat(path)
    except OSError:
        return
    if stat.S_ISREG(info.st_mode) and info.st_mode & 0o077:
        log.warning("tier %s: %s: mode %04o lets its group or others read or write the pool "
                    "(0600 expected); chmod 600 it", name, path, stat.S_IMODE(info.st_mode))


def _open_or_create(config: PmemTierConfig, name: str, capacity: int) -> pmemobj.Pool:
    path = config.path
    # pay the pool's page faults at open, not in the middle of puts and gets
    pmemobj.set_prefault(at_create=False, at_open=True)
    found = layout.inspect_pool(path)
    kind = found.kind
    if kind is layout.PoolFile.ABSENT:
        return _create_file(path, capacity)
    if kind is layout.PoolFile.EMPTY:
        log.info("tier %s: %s is empty: creating a pool there", name, path)
        return _recreate(path, kind, capacity)
    if kind in (layout.PoolFile.TIERKV, layout.PoolFile.DEVICE):
        try:
            return _open_usable(path)
        except _Unusable as exc:
            return _replace(config, name, kind, capacity, exc)
    what = f"{kind.value} {found.layout!r}" if found.layout else kind.value
    return _replace(config, name, kind, capacity, _Unusable(f"{path}: {what}, not a tierkv pool"))


def _replace(config: PmemTierConfig, name: str, kind: layout.PoolFile, capacity: int,
             unusable: _Unusable) -> pmemobj.Pool:
    """A new pool over media that holds no usable one: at once on a device whose header area
    is zero (it is new), else only with ``format = true``."""
    path = config.path
    if kind is layout.PoolFile.DEVICE and (pool := _create_on_zeroed(path)) is not None:
        log.info("tier %s: creating a pool on %s (its header area is zero)", name, path)
        return pool
    if not config.format:
        raise DeviceError(f"{unusable}; refusing to overwrite it (set format = true to "
                          "replace it, losing its contents)") from unusable
    log.warning("tier %s: replacing what is at %s (format = true): %s", name, path, unusable)
    return _recreate(path, kind, capacity)


def _open_usable(path: Path) -> pmemobj.Pool:
    """``pmemobj_open`` and the root check; `_Unusable` when PMDK finds the pool invalid
    (EINVAL: the checksum, version, layout or size of its header or descriptor; or its heap
    header, zone or chunk headers), when the pool is damaged where PMDK does not check
    (`_probe.Damaged`) or the root is not a tierkv root.

    The media is opened first in a probe process (`_probe`), and here only once that probe
    has opened and walked it: damage that would crash PMDK kills the probe, not this process.
    """
    try:
        _probe.probe_open(path, layout.LAYOUT_NAME, layout.ROOT_SIZE)
        pool = pmemobj.open_pool(path, layout.LAYOUT_NAME)
    except _probe.Damaged as exc:
        raise _Unusable(f"{path}: damaged pmem pool ({exc})") from exc
    except DeviceError as exc:
        code = pmemobj.failure_errno(exc)
        if code in pmemobj.IN_USE_ERRNOS:
            raise DeviceError(f"{path}: pmem pool is in use by another process "
                              "(or already open)") from exc
        # EINVAL: PMDK found the pool header, the descriptor or the layout invalid; a negative
        # "errno" is no OS error but the -1 that PMDK 1.12's heap verification (heap header,
        # zone and chunk headers) leaves in errno
        if code == errno.EINVAL or (code is not None and code < 0):
            raise _Unusable(f"{path}: damaged or foreign pmem pool ({exc})") from exc
        raise  # EACCES, EIO, ENOMEM...: the pool may be whole, it is no reason to replace it
    try:
        _check_root(pool, path)
    except BaseException:
        pool.close()
        raise
    return pool


def _create_on_zeroed(path: Path) -> pmemobj.Pool | None:
    """A new pool on a device whose header area is zero (new, or wiped), else ``None``: PMDK
    refuses (EEXIST) to create a pool over a pool header that is not all zero."""
    try:
        pool = pmemobj.create_pool(path, layout.LAYOUT_NAME, 0)
    except DeviceError as exc:
        if pmemobj.failure_errno(exc) == errno.EEXIST:
            return None
        raise
    try:
        _check_root(pool, path)
    except BaseException:
        pool.close()
        raise
    return pool


def _recreate(path: Path, kind: layout.PoolFile, capacity: int) -> pmemobj.Pool:
    if kind is layout.PoolFile.DEVICE:
        wipe_media(path, layout.HEADER_AREA)  # refused while a process holds the pool
        pool = _create_on_zeroed(path)
        if pool is None:
            raise DeviceError(f"{path}: still not a new device after its header was zeroed")
        return pool
    # PMDK holds an flock on an open pool: never unlink a file somebody still uses
    with path.open("rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise DeviceError(f"{path}: in use by another process") from exc
        return _create_file(path, capacity, replacing=True)


def _create_file(path: Path, capacity: int, *, replacing: bool = False) -> pmemobj.Pool:
    # Built under a temporary name and renamed into place once whole, so that a crash
    # during creation never leaves a half-made pool at the configured path (which a later
    # open would refuse as "not a pool"). A leftover temporary is our own: remove it. Where a
    # symlink points: renamed over the link itself, the pool left the link's target (a DAX
    # mount) for the link's directory, and the link was gone.
    path = Path(os.path.realpath(path))
    temporary = path.with_name(path.name + ".creating")
    with _creating_in(path):
        if not replacing and os.path.lexists(path):  # found absent: another open won
            raise DeviceError(f"{path}: another open created a pool there meanwhile; open again")
        temporary.unlink(missing_ok=True)
        pool = pmemobj.create_pool(temporary, layout.LAYOUT_NAME,
                                   layout.pool_size_for(capacity))
        try:
            _check_root(pool, path)
        finally:
            pool.close()
        try:
            os.replace(temporary, path)
        except OSError as exc:
            raise DeviceError(f"{path}: the new pool could not be put in place: {exc}") from exc
    return pmemobj.open_pool(path, layout.LAYOUT_NAME)


#: seconds an open waits for another's creation of a pool in the same directory
CREATE_WAIT = 30.0


@contextlib.contextmanager
def _creating_in(path: Path) -> Iterator[None]:
    """One creator of a pool at a time in `path`'s directory (an flock on the directory, held
    per open file description: two opens in one process exclude each other too), the others
    waiting up to `CREATE_WAIT`. Two opens of a new pool at once both made and removed the one
    temporary: both failed, and PMDK, its pool pulled from under it, refused every later pool
    of that size in the process."""
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise DeviceError(f"{path.parent}: cannot open the pool's directory: {exc}") from exc
    try:
        deadline = time.monotonic() + CREATE_WAIT
        while True:  # on the tier's open thread: polled, so that a stuck creator is reported
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DeviceError(f"{path}: another process has been creating a pool in "
                                      f"{path.parent} for {CREATE_WAIT:.0f}s") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def _check_root(pool: pmemobj.Pool, path: Path) -> None:
    """Check the pool's root record, writing it where it is still zeroed (a new pool);
    `_Unusable` when it is another layout's or corrupt."""
    address = pool.direct(pool.root(layout.ROOT_SIZE))
    raw = ctypes.string_at(address, layout.ROOT_SIZE)
    try:
        valid = layout.check_root(raw)
    except CorruptObjectError as exc:
        raise _Unusable(f"{path}: {exc}") from exc
    if not valid:
        pool.memcpy_persist(address, layout.encode_root(), layout.ROOT_SIZE)


def register_classes(pool: pmemobj.Pool) -> list[int]:
    """The allocation flags of each of `layout.SIZE_CLASSES`, registered with `pool`."""
    # one arena for every allocation: each arena holds a partly used run per class, and the
    # pool is sized for one run per class (formats/pmem_layout.py)
    arena = pmemobj.arena_flag(1) if pool.arena_count() >= 1 else 0
    return [
        pmemobj.class_flag(pool.register_class(cls.unit, cls.units_per_run)) | arena
        for cls in layout.SIZE_CLASSES
    ]


@dataclass(frozen=True, slots=True)
class Recovered:
    """What the recovery walk found: the newest whole record of each key, oldest first, and
    the keys whose newest record was damaged (`Tier.damaged_at_open`)."""

    objects: dict[bytes, PoolObject]
    damaged: frozenset[bytes]


@dataclass(frozen=True, slots=True)
class _Damaged:
    """A record whose payload failed its checksum while its header still names its key."""

    key: bytes
    order: tuple[int, int]  # (generation, sequence), as records of one key are ordered


def recover(pool: pmemobj.Pool, name: str, counters: dict[str, int]) -> Recovered:
    """The newest whole record of each key in `pool`, oldest first (by sequence: the order an
    LRU list of what was written would hold them in).

    Walks every object; frees the ones that fail their checks and the older record of a key,
    counting each kind in the tier's `counters` as it goes (`*_freed_at_open`). A damaged
    record newer than a key's whole one superseded it (a crash never leaves a record half
    written: this is media damage): the whole one is freed too, so the key is a miss, never
    the older value. What exceeds the capacity (a pool reopened with a smaller one) is kept:
    the tier reports it over its capacity, and the engine's evictor moves the oldest out, into
    a lower tier where there is one (freed here, they were lost even where the log below had
    room).
    """
    found: dict[bytes, PoolObject] = {}
    damaged: dict[bytes, tuple[int, int]] = {}
    oid = pool.first()
    while oid is not None:
        following = pool.next(oid)
        record = _check_record(pool, oid, name)
        if record is None or isinstance(record, _Damaged):
            counters["corrupt_freed_at_open"] += 1
            pool.free(oid)
            if isinstance(record, _Damaged):
                damaged[record.key] = max(record.order, damaged.get(record.key, record.order))
        else:
            key, obj = record
            old = found.get(key)
            if old is not None:
                if (old.meta.generation, old.sequence) > (obj.meta.generation, obj.sequence):
                    old, obj = obj, old
                counters["superseded_freed_at_open"] += 1
                pool.free(old.oid)
            found[key] = obj
        oid = following
    for key, order in damaged.items():
        whole = found.get(key)
        if whole is not None and (whole.meta.generation, whole.sequence) < order:
            counters["superseded_freed_at_open"] += 1
            pool.free(whole.oid)
            del found[key]
    return Recovered(dict(sorted(found.items(), key=lambda item: item[1].sequence)),
                     frozenset(key for key in damaged if key not in found))


def _check_record(pool: pmemobj.Pool, oid: pmemobj.Oid,
                  name: str) -> tuple[bytes, PoolObject] | _Damaged | None:
    """The record at `oid`; `_Damaged` where only its payload fails, None where it is no
    record (or its prefix or header is damaged: whose it was is unknown)."""
    if pool.type_num(oid) != layout.OBJECT_TYPE_NUM:
        log.warning("tier %s: freeing an object of unknown type %#x", name, pool.type_num(oid))
        return None
    usable = pool.usable_size(oid)
    address = pool.direct(oid)
    view = pool_view(address, usable)
    try:
        try:
            info = layout.decode_record(view)
        except CorruptObjectError as exc:
            log.warning("tier %s: freeing a corrupt object at offset %#x: %s", name, oid.off,
                        exc)
            return None
        header = info.header
        try:
            verify_payload(header, view[info.payload_offset : info.record_size])
        except CorruptObjectError as exc:
            log.warning("tier %s: freeing a corrupt object at offset %#x: %s", name, oid.off,
                        exc)
            return _Damaged(header.key, (header.meta.generation, info.sequence))
    finally:
        view.release()
    obj = PoolObject(oid, address, header.meta, info.payload_offset, header.payload_checksum,
                     usable + layout.ALLOC_HEADER, info.sequence)
    return header.key, obj
