"""Host buffers for `get` results whose memory is reused once the caller lets go of them.

A get returns a buffer the caller owns. Allocating a fresh one per get costs page faults: glibc
serves a multi-MiB request with a new mapping, or from heap memory that it trimmed back to the
kernel after the previous free, so every page of the result is faulted in again and zeroed by
the kernel before the copy writes it (measured: ~160 faults per 4 MiB get at 8 in flight, 4.5 times
the copy's own time; docs/benchmarks-pmem.md). The recycler keeps the memory of dropped results
and hands it out again, untouched by the kernel.

How ownership works: `take` returns a numpy *view* of a backing array; a `weakref.finalize` on
the view puts the backing array back on the free list when the view is collected, which with
CPython's reference counting is the moment the last user of the result (its memoryview, a
tensor or array made from it) drops it. Nothing is recycled while anything still refers to the
result. Retention is bounded: at most `retain_bytes` of free memory are kept, the rest is
released to the allocator as usual. Buckets are by exact size (cached blocks come in few sizes).

Not thread-safe by itself: `take` runs on the event loop; a finalizer may run on any thread that
drops the last reference, so the free lists are guarded by a lock.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import defaultdict

import numpy as np
import numpy.typing as npt

#: results below this size come from the allocator's small-object pools anyway
MIN_RECYCLED = 64 << 10

_bytes_of_size = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_of_size.restype = ctypes.py_object
_bytes_of_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable ABI since 3.11)."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),  # a reference `PyBuffer_Release` gives back, never read here
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.restype = ctypes.c_int
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.restype = None
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_PYBUF_SIMPLE = 0


def address_of(view: memoryview | npt.NDArray[np.uint8]) -> int:
    """The address of a contiguous host buffer, read-only ones included (for a copy in C); 0 for
    an empty one. `BufferError` for a buffer that is not contiguous.

    Asked of the buffer protocol directly: numpy's ``frombuffer(view).ctypes.data`` took 10-12 µs
    of the loop per 1 MiB pmem put in place (its helper objects and the collections they set
    off), this 3 µs (docs/benchmarks.md, session 16).
    """
    if not view.nbytes:
        return 0
    buffer = _PyBuffer()
    try:
        _get_buffer(view, buffer, _PYBUF_SIMPLE)
    except ValueError as exc:  # numpy's word for it
        raise BufferError(str(exc)) from None
    try:
        return int(buffer.buf)
    finally:
        _release_buffer(buffer)


def fresh_bytes(nbytes: int) -> tuple[bytes, npt.NDArray[np.uint8]]:
    """A new `bytes` of `nbytes` whose contents are not yet written, and a uint8 array over it
    for the copy that fills it (through its address: the array itself is read-only).

    A get of a bytes value must return `bytes`; copying into a buffer and then into `bytes`
    doubled the loop's work per large get (a 1 MiB copy on the loop for every pmem hit). The
    object is CPython's own (``PyBytes_FromStringAndSize(NULL, n)``, as `bytes` methods make
    theirs) and is written before anything else sees it: the tier hands it out only once the
    copy into it has ended and matched its checksum, else drops it.
    """
    fresh: bytes = _bytes_of_size(None, nbytes)
    return fresh, np.frombuffer(fresh, dtype=np.uint8)


class BufferRecycler:
    """See the module docstring."""

    def __init__(self, retain_bytes: int) -> None:
        self._retain = retain_bytes
        self._free: defaultdict[int, list[npt.NDArray[np.uint8]]] = defaultdict(list)
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0

    def take(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """An uninitialised uint8 array of `nbytes` the caller owns (see the module docstring)."""
        if nbytes < MIN_RECYCLED:
            return np.empty(nbytes, dtype=np.uint8)
        backing = None
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                backing = bucket.pop()
                if not bucket:
                    # its buffer may never come back (no room then): an empty list kept per
                    # size ever seen grew without bound with varied sizes
                    del self._free[nbytes]
                self._free_bytes -= nbytes
                self.reused += 1
        if backing is None:
            backing = np.empty(nbytes, dtype=np.uint8)
        view = backing.view()
        weakref.finalize(view, self._give_back, backing)
        return view

    def _give_back(self, backing: npt.NDArray[np.uint8]) -> None:
        with self._lock:
            if self._free_bytes + backing.nbytes <= self._retain:
                self._free[backing.nbytes].append(backing)
                self._free_bytes += backing.nbytes

    @property
    def free_bytes(self) -> int:
        return self._free_bytes
