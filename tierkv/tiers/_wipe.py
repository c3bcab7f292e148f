"""Making a persistent tier's media new again: what `tierkv format` does to each tier.

Separate from the tiers because it is the same for both persistent kinds and knows one fact of
their formats, the size of the header area each recognises its media by. A regular file is
truncated to size 0, which every persistent tier's next open treats as new (it creates its
format there whatever ``format`` says). A device cannot shrink: its header area is zeroed
instead, which both kinds also treat as new (a block device is written with ``pwrite``; a device
DAX character device, which has no ``write(2)``, through a shared mapping of its first aligned
extent). Nothing past the header area is touched: the old bytes there are unreachable once the
header is gone.

While it writes, the wipe holds an exclusive ``flock`` on the media, and it refuses media on
which another open file holds one: PMDK takes one on every pool it opens, and the nvme tier one
on its log for as long as it is open, so an open tier's media is never wiped under its user (in
this process or another). Taking the media (`claim`: opened, locked, its kind checked) is apart
from writing it (`Claim.wipe`), so that several tiers are all taken before any is written: a
wipe of a config's tiers refuses them all, untouched, where one cannot be had.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from tierkv._units import format_size
from tierkv.errors import DeviceError

#: mapping granule of a device DAX whose alignment sysfs does not tell (the kernel's default)
_DAX_ALIGN = 2 << 20


class WipeAction(enum.Enum):
    NOTHING = "absent, nothing to wipe"
    TRUNCATED = "truncated to 0 bytes"
    ZEROED = "header zeroed"


@dataclass(frozen=True, slots=True)
class Wiped:
    """What a wipe did: `size` is the file's size before (truncated) or the bytes zeroed."""

    path: Path
    action: WipeAction
    size: int = 0

    def __str__(self) -> str:
        if self.action is WipeAction.TRUNCATED:
            return f"{self.path}: {self.action.value} (was {format_size(self.size)})"
        if self.action is WipeAction.ZEROED:
            return f"{self.path}: {self.action.value} (first {format_size(self.size)})"
        return f"{self.path}: {self.action.value}"


class Claim:
    """Media opened for a wipe under an exclusive ``flock``, held until `release` (which closes
    it; idempotent): nothing else can open the tier meanwhile. `fd` is None for media that
    does not exist (nothing to wipe)."""

    __slots__ = ("fd", "info", "path")

    def __init__(self, path: Path, fd: int | None, info: os.stat_result | None) -> None:
        self.path = path
        self.fd = fd
        self.info = info

    def wipe(self, header_area: int) -> Wiped:
        """Leave the media new (see the module docstring), durable before this returns;
        `DeviceError` naming the path when a write fails (only that leaves anything
        changed)."""
        if self.fd is None or self.info is None:
            return Wiped(self.path, WipeAction.NOTHING)
        try:
            if stat.S_ISREG(self.info.st_mode):
                os.ftruncate(self.fd, 0)
                os.fsync(self.fd)
                return Wiped(self.path, WipeAction.TRUNCATED, self.info.st_size)
            if stat.S_ISBLK(self.info.st_mode):
                _zero_written(self.fd, header_area)
            else:
                _zero_mapped(self.fd, header_area, _dax_alignment(self.info.st_rdev))
        except OSError as exc:
            raise DeviceError(f"{self.path}: wipe failed: {exc.strerror}") from exc
        return Wiped(self.path, WipeAction.ZEROED, header_area)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


def claim(path: Path) -> Claim:
    """The media at `path`, opened and locked for a wipe, nothing written yet. `DeviceError`
    naming the path when it cannot be opened, is held by another open file (an open pool or
    log), or is neither a regular file nor a device."""
    try:
        # a block device opened exclusively, as the nvme tier opens it: its flock is per device
        # node, and a tier holding the device through another node was wiped under it
        block = stat.S_ISBLK(os.stat(path).st_mode)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_EXCL if block else 0))
    except FileNotFoundError:
        return Claim(path, None, None)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise DeviceError(f"{path}: in use (open exclusively by a tier, another process or "
                              "a mounted filesystem); not wiped") from exc
        raise DeviceError(f"{path}: cannot open it to wipe it: {exc.strerror}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DeviceError(f"{path}: cannot lock it to wipe it: {exc.strerror}") from exc
            raise DeviceError(f"{path}: in use by another process (or an open tier); "
                              "not wiped") from exc
        info = os.fstat(fd)
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISBLK(info.st_mode)
                or stat.S_ISCHR(info.st_mode)):
            raise DeviceError(f"{path}: neither a regular file nor a device; not wiped")
    except BaseException:
        os.close(fd)
        raise
    return Claim(path, fd, info)


def wipe_media(path: Path, header_area: int) -> Wiped:
    """`claim` the media at `path` and wipe it (`Claim.wipe`), releasing it after."""
    taken = claim(path)
    try:
        return taken.wipe(header_area)
    finally:
        taken.release()


def _zero_written(fd: int, size: int) -> None:
    zeros = memoryview(bytes(size))
    done = 0
    while done < size:
        done += os.pwrite(fd, zeros[done:], done)
    os.fsync(fd)


def _zero_mapped(fd: int, size: int, alignment: int) -> None:
    # a device DAX maps only whole aligned extents
    length = -(-size // alignment) * alignment
    with mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
        mapped[:size] = bytes(size)
        mapped.flush()


def _dax_alignment(rdev: int) -> int:
    base = Path(f"/sys/dev/char/{os.major(rdev)}:{os.minor(rdev)}")
    for attribute in (base / "align", base / "device" / "align"):
        try:
            return int(attribute.read_text().strip())
        except (OSError, ValueError):
            continue
    return _DAX_ALIGN
