"""Checks of a configuration against the machine: devices that must exist, paths that must be
usable, capacities the memory, the device or the file system must hold.

Separate from the parsing (`loading`) because these read the machine (torch's CUDA devices,
`stat`, `statvfs`, physical memory) where the parsing reads only the document. Each check raises
`ConfigError` naming the key path, through the `KeyErrors` of the table it checks.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from tierkv._platform import RAMFS_MAGIC, cuda_available, filesystem_type, physical_memory
from tierkv._units import format_size
from tierkv.config.schema import (
    NVME_SUPERBLOCK,
    NvmeTierConfig,
    PmemTierConfig,
    TierConfig,
    TierKind,
)
from tierkv.errors import ConfigError
from tierkv.formats.pmem_layout import pool_size_for


class KeyErrors(Protocol):
    """What a check needs of the table it checks: an error for one of its keys."""

    def error(self, key: str, message: str) -> ConfigError: ...


def check_device(t: KeyErrors, device: str) -> str:
    """The device a gpu tier names, normalised (`cuda` → `cuda:0`); it must exist here."""
    import torch

    if device in ("auto", "cpu"):
        return device
    if device == "cuda" or device.startswith("cuda:"):
        suffix = device.partition(":")[2]
        # ASCII digits, at least one: str.isdigit also takes full-width and superscript
        # digits (int reads a full-width 1 as 1), and an empty "cuda:" was read as cuda:0
        if device != "cuda" and not (suffix.isascii() and suffix.isdigit()):
            raise t.error("device", f"{device!r} is not a device (use auto, cpu or cuda:N)")
        if not torch.cuda.is_available():
            raise t.error("device", f"{device!r} requested but this machine has no CUDA device")
        index = int(suffix or 0)
        if index >= torch.cuda.device_count():
            raise t.error(
                "device", f"{device!r} does not exist ({torch.cuda.device_count()} CUDA devices)"
            )
        return f"cuda:{index}"
    raise t.error("device", f"{device!r} is not a device (use auto, cpu or cuda:N)")


#: the sysfs class or bus of a device-DAX character device (``/sys/dev/char/MAJ:MIN/subsystem``)
_DAX_SUBSYSTEM = "dax"


def is_dax_device(found: os.stat_result) -> bool:
    """Whether `found` is a device-DAX character device (``/dev/daxX.Y``): its sysfs subsystem
    is ``dax``. Any other character device (/dev/null, /dev/zero, a tty) is not a pool."""
    if not stat.S_ISCHR(found.st_mode):
        return False
    rdev = f"{os.major(found.st_rdev)}:{os.minor(found.st_rdev)}"
    try:
        subsystem = Path("/sys/dev/char", rdev, "subsystem").resolve(strict=True)
    except (OSError, RuntimeError):
        return False
    return subsystem.name == _DAX_SUBSYSTEM


def _is_block_device(found: os.stat_result) -> bool:
    return stat.S_ISBLK(found.st_mode)


#: what a persistent tier's path may name besides a regular file: the pmem pool a device-DAX
#: character device, the nvme log a block device
_DEVICES: dict[TierKind, tuple[Callable[[os.stat_result], bool], str]] = {
    TierKind.PMEM: (is_dax_device, "a device-DAX character device (/dev/daxX.Y)"),
    TierKind.NVME: (_is_block_device, "a block device"),
}


def check_path(t: KeyErrors, key: str, text: str, kind: TierKind, directory: Path | None) -> Path:
    """The path of a persistent tier: usable here (creatable in a writable directory that
    exists, or a file or device of the right kind that is readable and writable). A relative
    path is taken in `directory` (the config file's), or left relative where it is None."""
    if "\x00" in text:
        raise t.error(key, "a path cannot contain a NUL byte")
    if text.endswith("/"):
        # Path drops the slash: "log/" made or used a file named "log"
        raise t.error(key, f"{text} ends with '/', which names a directory; the pool or log is "
                           "a file or device")
    try:
        # expanduser raises RuntimeError for ~user of no such user (or no home to be found)
        path = Path(text).expanduser()
        if directory is not None:
            path = directory / path  # an absolute `path` stays as it is
        path.resolve()
    except (OSError, RuntimeError) as exc:
        raise t.error(key, f"{text} cannot be resolved: {exc}") from None
    try:
        return _usable_path(t, key, path, kind)
    except OSError as exc:
        # Path.exists and is_dir let through what is not "no such file": a name longer than
        # the file system allows, a directory that may not be searched
        raise t.error(key, f"{path} cannot be used: {exc.strerror or exc}") from None


def _usable_path(t: KeyErrors, key: str, path: Path, kind: TierKind) -> Path:
    if path.exists():
        found = path.stat()
        mode = found.st_mode
        is_device, device = _DEVICES[kind]
        if stat.S_ISDIR(mode):
            raise t.error(key, f"{path} is a directory, expected a file or {device}")
        # a FIFO would block the first open (tierkv info hung on one); /dev/null and the like
        # only failed at open
        if not (stat.S_ISREG(mode) or is_device(found)):
            raise t.error(key, f"{path} is neither a regular file nor {device}")
        if not os.access(path, os.R_OK | os.W_OK):
            raise t.error(key, f"{path} is not readable and writable")
        return path
    # the open creates the file, not the directories above it: a directory missing here is a
    # file system not mounted (/mnt/pmem0) or a path mistyped, refused now rather than at open
    directory = path.parent
    if not directory.exists():
        raise t.error(key, f"directory {directory} does not exist")
    if not directory.is_dir():
        raise t.error(key, f"{path} cannot be created: {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise t.error(key, f"{path} cannot be created: {directory} is not writable")
    return path


#: what every path naming one file or device shares (`media_identity`)
MediaIdentity = tuple[int | str, ...]


def media_identity(path: Path) -> MediaIdentity:
    """What every path naming the media at `path` shares, however it names it: a device node
    its device number (two nodes made for one device), an existing file its device and inode
    (a hard link, a symlink, a bind mount), a file yet to be made its directory's device and
    inode and its name (the directory through a symlink or a bind mount). A path that cannot
    be looked up is its absolute spelling."""
    try:
        # follows a symlink to a file not made yet, to where the open will make it
        resolved = path.resolve()
        try:
            found = resolved.stat()
        except FileNotFoundError:
            directory = resolved.parent.stat()
            return ("new", directory.st_dev, directory.st_ino, resolved.name)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        return ("path", os.path.abspath(path))
    if stat.S_ISBLK(found.st_mode) or stat.S_ISCHR(found.st_mode):
        return ("device", stat.S_IFMT(found.st_mode), found.st_rdev)
    return ("file", found.st_dev, found.st_ino)


def check_memory(t: KeyErrors, device: str, capacity: int) -> None:
    """A gpu tier allocates its whole capacity at open: refuse one its device cannot hold,
    rather than let the allocation fail (or the OOM killer end the process) later."""
    if device == "auto":
        device = "cuda:0" if cuda_available() else "cpu"
    if device == "cpu":
        total, where = physical_memory(), "the machine's physical memory"
    else:
        import torch

        index = int(device.partition(":")[2] or 0)
        total, where = torch.cuda.get_device_properties(index).total_memory, device
    if capacity > total:
        raise t.error("capacity", f"{format_size(capacity)} does not fit in {where} "
                                  f"({format_size(total)})")


def _media_size(tier: PmemTierConfig | NvmeTierConfig) -> int:
    """Bytes the tier sizes its file or device to at open."""
    if isinstance(tier, PmemTierConfig):
        return pool_size_for(tier.capacity)
    regions = (tier.capacity - NVME_SUPERBLOCK) // tier.region_size
    return NVME_SUPERBLOCK + regions * tier.region_size


def _block_device_size(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def check_room(tiers: tuple[TierConfig, ...]) -> None:
    """Refuse a persistent tier whose media cannot hold what open sizes it to.

    A block device must be large enough. A file is allocated in full at open (the nvme log
    with posix_fallocate, the pmem pool by PMDK), so the bytes it still has to grow by must be
    free on its file system, summed over the tiers that share one; except on ramfs, which
    reports no free space at all and takes files until the memory is full. A character device
    (device DAX) is left to the open. Without this a capacity beyond the machine passed here
    and failed at open, late (after building per-region state for all of it) and unclearly.
    """
    growth: dict[int, int] = {}  # st_dev of a file system -> bytes its tiers' files must grow
    for index, tier in enumerate(tiers):
        if not isinstance(tier, PmemTierConfig | NvmeTierConfig):
            continue
        key = f"tiers[{index}].capacity"
        need = _media_size(tier)
        try:
            found: os.stat_result | None = os.stat(tier.path)
        except FileNotFoundError:
            found = None
        try:
            if found is not None and stat.S_ISBLK(found.st_mode):
                size = _block_device_size(tier.path)
                if need > size:
                    raise ConfigError(f"{key}: {format_size(tier.capacity)} needs {need} bytes, "
                                      f"the block device {tier.path} has {size}")
                continue
            if found is not None and not stat.S_ISREG(found.st_mode):
                continue
            grow = need - (found.st_blocks * 512 if found is not None else 0)
            if grow <= 0:
                continue
            directory = tier.path.parent
            device = os.stat(directory).st_dev
            fs = os.statvfs(directory)
        except OSError as exc:
            raise ConfigError(f"tiers[{index}].path: {tier.path} cannot be sized: "
                              f"{exc.strerror or exc}") from None
        if filesystem_type(directory) == RAMFS_MAGIC:
            continue  # ramfs reports 0 free whatever it holds: it grows into the memory
        free = fs.f_bavail * fs.f_frsize
        growth[device] = growth.get(device, 0) + grow
        if growth[device] > free:
            shared = " with the tiers before it" if growth[device] > grow else ""
            raise ConfigError(
                f"{key}: {format_size(tier.capacity)} needs {format_size(grow)} more on the "
                f"file system of {directory}{shared}, which has {format_size(free)} free"
            )
