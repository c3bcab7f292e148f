"""Opening the NVMe tier's file or block device: O_DIRECT, the exclusive lock that keeps a
second opener off it, sizes, block size, backend choice.

Nothing here writes to the device; formatting decisions are the tier's (it reads the superblock
through the chosen backend first).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from tierkv._fork import keep, release_in_children
from tierkv._platform import io_uring_available
from tierkv.config import NvmeBackend, NvmeTierConfig
from tierkv.errors import DeviceError
from tierkv.tiers.nvme.io._blockio import BlockIO

log = logging.getLogger(__name__)

_BLKSSZGET = 0x1268
_BLKGETSIZE64 = 0x80081272
SAFE_ALIGNMENT = 4096


@dataclass(frozen=True, slots=True)
class Device:
    fd: int
    path: Path
    block_device: bool
    direct: bool
    size: int
    logical_block_size: int | None
    created: bool

    @property
    def alignment(self) -> int:
        return max(SAFE_ALIGNMENT, self.logical_block_size or 0)


def open_device(config: NvmeTierConfig) -> Device:
    """Open (creating a regular file if absent) the tier's path read-write, and lock it.

    With ``direct = true`` the fd is opened with O_DIRECT; if the filesystem refuses it (EINVAL)
    the tier falls back to buffered IO, logs a warning and says so in `describe()`.
    The fd holds an exclusive ``flock`` until it is closed: a second opener, in this process or
    another (or `tierkv format`), is refused while the tier is open. A regular file whose mode
    lets its group or others in is opened with a warning.
    Raises `DeviceError` naming the path when it cannot be opened, created or locked (naming the
    holder where /proc/locks tells it); a file this call created is removed again then.
    """
    path = config.path
    try:
        existing = os.stat(path)
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise DeviceError(f"{path}: cannot stat: {exc.strerror}", errno=exc.errno) from exc
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise DeviceError(f"{path}: is a directory, expected a file or block device")
    block = existing is not None and stat.S_ISBLK(existing.st_mode)
    fd, direct, created = _open_fd(path, existing is None, config.direct, exclusive=block)
    try:
        _lock(fd, path)
        release_in_children(fd)  # a forked child must not hold the lock on (`tierkv._fork`)
        info = os.fstat(fd)
        block = stat.S_ISBLK(info.st_mode)
        if block:
            size = struct.unpack("<Q", fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8))[0]
            lbs = struct.unpack("<i", fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4))[0]
        elif stat.S_ISREG(info.st_mode):
            size = info.st_size
            lbs = _file_logical_block_size(info.st_dev)
            if info.st_mode & 0o077:
                log.warning("%s: mode %04o lets its group or others read or write the log "
                            "(0600 expected); chmod 600 it", path, stat.S_IMODE(info.st_mode))
        else:
            raise DeviceError(f"{path}: neither a regular file nor a block device")
    except BaseException as exc:
        # removed before the close drops the lock, so that no other opener can be using it;
        # but a file another opener locked first (it opened what this call created) is theirs
        if created and not (isinstance(exc, DeviceError) and exc.errno == errno.EWOULDBLOCK):
            with contextlib.suppress(OSError):
                os.unlink(path)
        keep(fd)
        os.close(fd)
        if isinstance(exc, OSError):
            raise DeviceError(f"{path}: cannot read its size: {exc.strerror}",
                              errno=exc.errno) from exc
        raise
    return Device(fd, path, block, direct, size, lbs, created)


def _open_fd(path: Path, create: bool, direct: bool, *, exclusive: bool = False
             ) -> tuple[int, bool, bool]:
    """A read-write fd on `path`, whether it is O_DIRECT, and whether this call created the file.

    `exclusive` (a block device): opened with O_EXCL, which Linux makes exclusive per device,
    whatever node names it (EBUSY: `LockHeldError`). The flock is per inode, and each device
    node is one: two engines naming one device through two nodes (two containers' /dev) both
    opened it, and each overwrote the other's log.

    The file is created without O_DIRECT: a filesystem that refuses O_DIRECT (ramfs, tmpfs
    before Linux 6.6) creates the file before it fails the open with EINVAL, so an O_DIRECT
    create would leave a file behind that a retry with O_EXCL then cannot create.
    """
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_EXCL if exclusive else 0)
    fd: int | None = None
    if create:
        try:
            # the log holds every tenant's data: readable by its owner only; made where a
            # symlink points (O_EXCL on the link itself found it there: EEXIST, then the open
            # below failed with "No such file or directory")
            fd = os.open(os.path.realpath(path), flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # created by another opener since the stat: opened as it is, below
        except OSError as exc:
            raise DeviceError(f"{path}: cannot create: {exc.strerror}", errno=exc.errno) from exc
    created = fd is not None
    try:
        if direct:
            try:
                direct_fd = os.open(path, flags | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("%s: the filesystem refuses O_DIRECT; using buffered IO", path)
                direct = False
            else:
                if fd is not None:
                    os.close(fd)
                fd = direct_fd
        if fd is None:
            fd = os.open(path, flags)
    except OSError as exc:
        if fd is not None:
            os.close(fd)
        if created:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if exclusive and exc.errno == errno.EBUSY:
            # held by another opener (this engine's other tier, another process, a mount); one
            # killed a moment ago may still hold it while its io_uring is torn down
            raise LockHeldError(f"{path}: in use: the device is open exclusively elsewhere "
                                "(another tier or engine, or a mounted filesystem)",
                                live=False) from exc
        raise DeviceError(f"{path}: cannot open: {exc.strerror}", errno=exc.errno) from exc
    return fd, direct, created


class LockHeldError(DeviceError):
    """The log's flock is held; `live`: by a process that exists (or this one)."""

    def __init__(self, message: str, *, live: bool) -> None:
        super().__init__(message, errno=errno.EWOULDBLOCK)
        self.live = live


#: how long an open waits for a lock that no live process holds: the kernel keeps a killed
#: process's file open, and its flock held, until it has torn down that process's io_uring
#: (requests in flight hold the file), a moment after the process is gone and reaped. An open
#: right after a kill -9 (a supervisor's restart) was refused as "in use" meanwhile.
DEAD_HOLDER_WAIT = 5.0


async def open_device_when_free(config: NvmeTierConfig) -> Device:
    """`open_device`, waiting up to `DEAD_HOLDER_WAIT` while the lock's holder is no live
    process (a live one is refused at once)."""
    deadline = time.monotonic() + DEAD_HOLDER_WAIT
    while True:
        try:
            return open_device(config)
        except LockHeldError as exc:
            if exc.live or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.02)


def _lock(fd: int, path: Path) -> None:
    """Hold an exclusive flock on the open file: two writers of one log would each overwrite
    the other's regions and superblock, and whichever closed last would win. flock locks
    belong to the open file description, so a second open in this process conflicts too, and
    the kernel drops the lock when the holder's file is closed (see `DEAD_HOLDER_WAIT`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            holder, live = _holder(fd)
            raise LockHeldError(f"{path}: in use: {holder}; the log is open in another tier "
                                "or process", live=live) from exc
        raise DeviceError(f"{path}: cannot lock: {exc.strerror}", errno=exc.errno) from exc


def lock_holder(path: Path) -> str | None:
    """Who holds the log's lock now (an engine that has it open), as /proc/locks tells, or
    None (`tierkv info`). Read, not probed with a lock of its own: an open racing a probe
    found the file locked and was refused."""
    try:
        holder = _holder_of(os.stat(path))
    except OSError:
        return None
    return None if holder is None else holder[0]


def _holder(fd: int) -> tuple[str, bool]:
    """Who holds the flock on `fd`'s file, as far as /proc/locks tells, and whether that is a
    live process (this one included)."""
    try:
        holder = _holder_of(os.fstat(fd))
    except OSError:
        return "held by another process", True
    return ("held by another process", False) if holder is None else holder


def _holder_of(info: os.stat_result) -> tuple[str, bool] | None:
    """`_holder` of the file `info` describes; None when /proc/locks lists no flock on it."""
    table = Path("/proc/locks").read_text()
    # /proc/locks names a file by its filesystem's device (hex major:minor) and inode
    ident = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        # "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END"; waiters have "->" after N:
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[5] != ident:
            continue
        try:
            pid = int(fields[4])
        except ValueError:
            continue
        if pid <= 0:  # a holder gone, or in a pid namespace this process cannot see
            break
        if pid == os.getpid():
            return f"held by this process (pid {pid})", True
        return f"held by pid {pid}{_command(pid)}", Path(f"/proc/{pid}").exists()
    return None


def _command(pid: int) -> str:
    try:
        return f" ({Path(f'/proc/{pid}/comm').read_text().strip()})"
    except OSError:
        return ""


def _file_logical_block_size(st_dev: int) -> int | None:
    """The logical block size of the block device under a file's filesystem, if it has one."""
    base = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}")
    for candidate in (base / "queue/logical_block_size", base / "../queue/logical_block_size"):
        try:
            return int(candidate.read_text().strip())
        except (OSError, ValueError):
            continue
    return None  # tmpfs, overlay, network filesystems: no block device to ask


def make_backend(config: NvmeTierConfig, device: Device) -> BlockIO:
    """The IO backend `config.backend` asks for; AUTO picks io_uring when the kernel allows it."""
    reason = io_uring_available() if config.backend is not NvmeBackend.THREADS else None
    if config.backend is NvmeBackend.IO_URING and reason is not None:
        raise DeviceError(f"{config.path}: backend io_uring requested but {reason}")
    if config.backend is NvmeBackend.THREADS or reason is not None:
        if reason is not None:
            log.info("%s: io_uring unavailable (%s); using the thread-pool backend",
                     config.path, reason)
            if config.sq_poll is not None:
                log.warning("%s: sq_poll ignored: it needs io_uring", config.path)
        from tierkv.tiers.nvme.io._threads import ThreadIO

        return ThreadIO(device.fd, str(device.path), config.queue_depth)
    from tierkv.tiers.nvme.io._uring import UringIO

    try:
        return UringIO(device.fd, str(device.path), config.queue_depth, config.sq_poll)
    except OSError as exc:
        what = " with sq_poll (submission-queue polling)" if config.sq_poll is not None else ""
        raise DeviceError(f"{config.path}: cannot set up io_uring{what}: {exc}") from exc
