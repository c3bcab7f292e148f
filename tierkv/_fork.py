"""What a forked child must not keep of the tiers: the descriptors and mappings that hold the
media locks.

A process that forks (multiprocessing's default start method on Linux, a data loader's
workers) gives each child a copy of every descriptor and mapping. The log's and the pool's
locks are flocks, which belong to the open file description and last until its last reference
goes, a mapping of the file included: a child that lived on held the log's or the pool's lock
after the engine closed it, or after the engine's process died, and every later open was
refused as in use (naming the parent, or a dead pid, as the holder) for as long as the child
lived. So a child, at once after the fork (`os.register_at_fork`), points each such descriptor
at /dev/null (the number stays valid: a close of it later closes nothing of the parent's), and
the pool's mapping is not handed to children at all (``MADV_DONTFORK``): a child must not use
its parent's engine, whose tiers are the parent's alone (one that reads through its parent's
pmem tier is killed by SIGSEGV). A device-DAX pool's mapping, whose length the pool does not
tell here, is still inherited, and with it the lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading

_MADV_DONTFORK = 10

#: descriptors that lock media, and files whose every descriptor does (PMDK keeps its own)
_fds: set[int] = set()
_paths: set[str] = set()
_guard = threading.Lock()


def release_in_children(fd: int) -> None:
    """`fd` (a locked log) is not kept by processes forked from now on."""
    with _guard:
        _fds.add(fd)


def keep(fd: int) -> None:
    """`fd` is being closed: nothing to do for it in children any more."""
    with _guard:
        _fds.discard(fd)


def release_file_in_children(path: os.PathLike[str] | str, address: int, length: int) -> None:
    """The descriptors on `path` (the pool, which PMDK opened and locked) are not kept by
    children, nor its mapping at `address` (`length` bytes), where the kernel allows."""
    with _guard:
        _paths.add(os.path.realpath(path))
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    libc.madvise(start, length + (address - start), _MADV_DONTFORK)  # a refusal: the fds still go


def keep_file(path: os.PathLike[str] | str) -> None:
    with _guard:
        _paths.discard(os.path.realpath(path))


def _in_child() -> None:
    if not _fds and not _paths:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        targets = set(_fds)
        if _paths:
            with contextlib.suppress(OSError):
                for name in os.listdir("/proc/self/fd"):
                    with contextlib.suppress(OSError, ValueError):
                        if os.readlink(f"/proc/self/fd/{name}") in _paths:
                            targets.add(int(name))
        for fd in targets:
            if fd != null:
                with contextlib.suppress(OSError):
                    os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
    _fds.clear()
    _paths.clear()


os.register_at_fork(after_in_child=_in_child)
