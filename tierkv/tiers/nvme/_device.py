"""Opening the NVMe tier's file or block device: O_DIRECT, sizes, block size, backend choice.

Nothing here writes to the device; formatting decisions are the tier's (it reads the superblock
through the chosen backend first).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

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
    """Open (creating a regular file if absent) the tier's path read-write.

    With ``direct = true`` the fd is opened with O_DIRECT; if the filesystem refuses it (EINVAL)
    the tier falls back to buffered IO, logs a warning and says so in `describe()`.
    Raises `DeviceError` naming the path when it cannot be opened or created.
    """
    path = config.path
    created = False
    try:
        existing = os.stat(path)
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise DeviceError(f"{path}: cannot stat: {exc.strerror}") from exc
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise DeviceError(f"{path}: is a directory, expected a file or block device")
    flags = os.O_RDWR | os.O_CLOEXEC
    if existing is None:
        flags |= os.O_CREAT | os.O_EXCL
        created = True
    direct = config.direct
    fd = _open(path, flags | (os.O_DIRECT if direct else 0))
    if fd is None:
        log.warning("%s: the filesystem refuses O_DIRECT; using buffered IO", path)
        direct = False
        fd = _open(path, flags)
        if fd is None:  # pragma: no cover - EINVAL without O_DIRECT is not expected
            raise DeviceError(f"{path}: cannot open")
    try:
        info = os.fstat(fd)
        block = stat.S_ISBLK(info.st_mode)
        if block:
            size = struct.unpack("<Q", fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8))[0]
            lbs = struct.unpack("<i", fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4))[0]
        elif stat.S_ISREG(info.st_mode):
            size = info.st_size
            lbs = _file_logical_block_size(info.st_dev)
        else:
            raise DeviceError(f"{path}: neither a regular file nor a block device")
    except BaseException:
        os.close(fd)
        if created:
            os.unlink(path)
        raise
    return Device(fd, path, block, direct, size, lbs, created)


def _open(path: Path, flags: int) -> int | None:
    try:
        # the log holds every tenant's data: readable by its owner only
        return os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL and flags & os.O_DIRECT:
            return None
        raise DeviceError(f"{path}: cannot open: {exc.strerror}") from exc


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
