"""The native library's job queue, bound with ctypes: what every tier that copies on its workers
shares (tierkv/_native/copy_queue.c).

The library is built at install time (setup.py) and is optional. Its workers run each job wholly
in C, never taking the GIL: the pmem tier's puts and checksummed gets (whose PMDK side it binds
itself, `tiers/pmem/_native.py`) and plain copies, which the gpu tier's host slots on the CPU
use for large objects. This module needs no PMDK: it binds the job structure, the queue's calls
and the checks that the library on disk is the one these bindings mirror.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
from pathlib import Path

import tierkv._native

log = logging.getLogger(__name__)

LIBRARY_STEM = "pmem_copy"
#: `TKV_ABI_VERSION` of tierkv/_native/copy_queue.h that these bindings mirror
ABI_VERSION = 4

OP_PUT = 1
OP_GET = 2
OP_COPY = 3

#: ``tkv_sizeof``'s index of ``struct tkv_job``
JOB_STRUCT = 2


class Job(ctypes.Structure):
    """``struct tkv_job``: one put, checksummed get or plain copy queued to the workers."""

    _fields_ = (
        ("id", ctypes.c_uint64),
        ("op", ctypes.c_uint32),
        ("status", ctypes.c_int32),
        ("error", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("put", ctypes.c_void_p),
        ("oid", ctypes.c_uint64 * 2),  # a put's tkv_oid: pool_uuid_lo, off
        ("dest", ctypes.c_void_p),
        ("src", ctypes.c_void_p),
        ("len", ctypes.c_size_t),
        ("expected", ctypes.c_uint64),
        ("next", ctypes.c_void_p),
        ("message", ctypes.c_char * 256),
    )


class QueueCalls:
    """The queue's C functions of one loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.path = Path(library._name)
        # submit and reap take a mutex that workers hold for a list append: they keep the GIL
        held = ctypes.PyDLL(str(self.path))
        self.create = library.tkv_queue_create
        self.create.restype = ctypes.c_void_p
        self.create.argtypes = (ctypes.c_int,)
        self.eventfd = held.tkv_queue_eventfd
        self.eventfd.restype = ctypes.c_int
        self.eventfd.argtypes = (ctypes.c_void_p,)
        self.submit = held.tkv_queue_submit
        self.submit.restype = None
        self.submit.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        self.kick = held.tkv_queue_kick
        self.kick.restype = None
        self.kick.argtypes = (ctypes.c_void_p,)
        self.reap = held.tkv_queue_reap
        self.reap.restype = ctypes.c_int
        self.reap.argtypes = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int)
        self.destroy = library.tkv_queue_destroy
        self.destroy.restype = None
        self.destroy.argtypes = (ctypes.c_void_p,)


def library_path() -> Path | None:
    """The built library in the package, or ``None`` when it was not built."""
    folder = Path(tierkv._native.__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = folder / f"{LIBRARY_STEM}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def job_mismatch(library: ctypes.CDLL) -> str:
    """Why `library`'s queue does not match these bindings ('' when it does): another ABI
    version, or a job structure of another size (a stale build would read and write past the
    structures Python hands it)."""
    try:
        version = library.tkv_abi_version
        sizeof = library.tkv_sizeof
    except AttributeError:
        return "it predates ABI versioning"
    version.restype, version.argtypes = ctypes.c_int, ()
    sizeof.restype, sizeof.argtypes = ctypes.c_size_t, (ctypes.c_int,)
    if version() != ABI_VERSION:
        return f"ABI version {version()}, these bindings need {ABI_VERSION}"
    if sizeof(JOB_STRUCT) != ctypes.sizeof(Job):
        return (f"struct Job is {sizeof(JOB_STRUCT)} bytes there and {ctypes.sizeof(Job)} "
                "here")
    return ""


@functools.cache
def load_queue() -> QueueCalls | None:
    """The queue of the built library, or ``None`` (logged once) when it is not built, cannot
    be loaded or is stale: its users keep their copies on the loop or their Python threads."""
    path = library_path()
    if path is None:
        log.warning("the native copy library is not built (needs gcc and libxxhash-dev at "
                    "install time: scripts/setup); large copies stay on slower paths")
        return None
    try:
        library = ctypes.CDLL(str(path), use_errno=True)
    except OSError as exc:
        log.warning("the native copy library %s cannot be loaded (%s); large copies stay on "
                    "slower paths", path, exc)
        return None
    mismatch = job_mismatch(library)
    if mismatch:
        log.warning("the native copy library %s is stale (%s): rebuild it with scripts/setup; "
                    "large copies stay on slower paths", path, mismatch)
        return None
    return QueueCalls(library)
