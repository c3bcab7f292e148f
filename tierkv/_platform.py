"""Detection of what this machine offers: CUDA, io_uring, libpmemobj, O_DIRECT on a path."""

from __future__ import annotations

import ctypes.util
import functools
import os
import tempfile
from pathlib import Path


@functools.cache
def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@functools.cache
def io_uring_available() -> str | None:
    """``None`` when io_uring works here, else why not."""
    try:
        import pyuring
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        return f"pyuring is not importable: {exc}"
    try:
        ctx = pyuring.direct.UringCtx(entries=2)
    except Exception as exc:
        return f"io_uring_setup failed: {exc}"
    ctx.close()
    return None


#: io_uring_setup(2)'s flag for a kernel thread that polls the submission queue
IORING_SETUP_SQPOLL = 1 << 1


@functools.cache
def io_uring_sqpoll_available() -> str | None:
    """``None`` when an io_uring with submission-queue polling can be set up here, else why not
    (kernels before 5.11 reserve it to privileged users; some sandboxes refuse it)."""
    reason = io_uring_available()
    if reason is not None:
        return reason
    import pyuring

    try:
        ctx = pyuring.direct.UringCtx(entries=2, setup_flags=IORING_SETUP_SQPOLL,
                                        sq_thread_idle=1)
    except Exception as exc:
        return f"io_uring_setup with IORING_SETUP_SQPOLL failed: {exc}"
    ctx.close()
    return None


@functools.cache
def libpmemobj_available() -> str | None:
    """``None`` when libpmemobj and libpmem can be loaded, else why not."""
    for name in ("pmemobj", "pmem"):
        if ctypes.util.find_library(name) is None:
            return f"lib{name} is not installed (Debian package lib{name}1)"
    return None


def o_direct_supported(path: Path) -> bool:
    """Whether the filesystem that holds (or would hold) `path` accepts O_DIRECT."""
    directory = path if path.is_dir() else path.parent
    while not directory.exists():
        directory = directory.parent
    if path.exists() and not path.is_dir() and not path.is_file():
        directory = path  # a block device: try it directly, read-only
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return False
        os.close(fd)
        return True
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".tierkv-odirect-")
    except OSError:
        return False
    os.close(fd)
    try:
        fd = os.open(name, os.O_RDWR | os.O_DIRECT)
    except OSError:
        return False
    else:
        os.close(fd)
        return True
    finally:
        os.unlink(name)


def physical_memory() -> int:
    """Bytes of physical memory of this machine (cgroup limits are not looked at)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


#: statfs(2)'s f_type of ramfs, which has no size: it reports 0 blocks free and grows until the
#: memory is full
RAMFS_MAGIC = 0x858458F6


def filesystem_type(path: Path) -> int | None:
    """statfs(2)'s ``f_type`` (the file system's magic number) of `path`, or None where it
    cannot be read (not Linux, no such path). ``os.statvfs`` does not report it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statfs = libc.statfs
    except (OSError, AttributeError):
        return None
    # struct statfs begins with its f_type (__fsword_t, a C long); 256 bytes hold the rest
    buffer = ctypes.create_string_buffer(256)
    if statfs(os.fsencode(path), buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF
