"""A thin ctypes binding of libpmemobj (PMDK 1.12) and of libpmem's `pmem_is_pmem`.

Only what the PMem tier needs is bound, one Python method per C call. The shared objects are loaded
lazily (`_pmdk`) by their versioned names (``libpmemobj.so.1``, ``libpmem.so.1``: the unversioned
names exist only with the -dev packages); a machine without them gets `DeviceError` naming the
Debian package.

Errors: every failing call raises `DeviceError` whose message carries ``pmemobj_errormsg()``, read
in the thread that made the call (PMDK keeps it thread-local), and whose ``__cause__`` is an
`OSError` with the call's errno (``ENOMEM`` for a full pool, ``EWOULDBLOCK``/``EAGAIN`` for a pool
another process holds). Callers branch on that errno, never on message text.

Concurrency: ctypes releases the GIL for the duration of every C call, so copies and allocations
made from a worker thread do not stall the event loop. The exceptions are the calls that only
compute an address or read a header word (``pmemobj_direct``, ``pmemobj_alloc_usable_size``,
``pmemobj_type_num``) and ``pmem_drain`` (a store fence): they take nanoseconds and are bound
through `ctypes.PyDLL`, so they keep the GIL; releasing it around them can make the copy thread
wait for the busy loop thread to hand it back. PMDK itself is thread-safe for alloc/free on one
pool. A `Pool` must not be closed while another thread still uses it; its owner guarantees that.

Memory: addresses returned by `Pool.direct` point into the pool mapping and are valid only until
`Pool.close`; nothing here hands out Python objects that alias the mapping.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierkv._fork import keep_file, release_file_in_children
from tierkv._untracked import untrack
from tierkv.errors import DeviceError
from tierkv.formats import pmem_layout
from tierkv.tiers.pmem._pmdk import (
    API_MAJOR,
    API_MINOR,
    C_CONSTRUCTOR,
    HEADER_COMPACT,
    LIBPMEM,
    LIBPMEMOBJ,
    AllocClassDesc,
    Lib,
    PMEMoid,
    library,
)

# the C side lives in `_pmdk`; callers reach the whole binding through this module
__all__ = [
    "API_MAJOR", "API_MINOR", "HEADER_COMPACT", "IN_USE_ERRNOS", "LIBPMEM", "LIBPMEMOBJ",
    "MAX_ALLOC_SIZE", "MAX_LAYOUT", "MIN_POOL", "AllocClassDesc", "Constructor", "Lib", "Oid",
    "PMEMoid", "Pool", "arena_flag", "class_flag", "create_pool", "failure", "failure_errno",
    "library", "open_pool", "set_prefault",
]

#: PMEMOBJ_MAX_LAYOUT (with the terminating NUL): the size of the layout field on media
MAX_LAYOUT = pmem_layout.MAX_LAYOUT
MIN_POOL = 8 << 20  # PMEMOBJ_MIN_POOL
MAX_ALLOC_SIZE = 0x3FFDFFFC0  # PMEMOBJ_MAX_ALLOC_SIZE
IN_USE_ERRNOS = frozenset({errno.EWOULDBLOCK, errno.EAGAIN})
#: libpmem's ``PMEM_F_MEM_NODRAIN | PMEM_F_MEM_NONTEMPORAL``: streaming stores, no fence
_STREAM_FLAGS = (1 << 0) | (1 << 1)


@dataclass(frozen=True, slots=True)
class Oid:
    """A persistent object id (hashable; ``off == 0`` is OID_NULL and never handed out)."""

    pool_uuid_lo: int
    off: int

    def __post_init__(self) -> None:
        untrack(self)  # atoms only: no cycle can pass through it (`tierkv._untracked`)

    def as_c(self) -> PMEMoid:
        return PMEMoid(self.pool_uuid_lo, self.off)


def class_flag(class_id: int) -> int:
    """``POBJ_CLASS_ID(id)`` for `Pool.alloc`'s flags."""
    return class_id << 48


def arena_flag(arena_id: int) -> int:
    """``POBJ_ARENA_ID(id)`` for `Pool.alloc`'s flags."""
    return arena_id << 32


#: what a constructor does: fill `size` bytes at `address`, and persist them, before PMDK publishes
Constructor = Callable[[int], None]


def _fail(lib: Lib, what: str) -> DeviceError:
    """The error of the call that just failed in this thread (errno and errormsg read now)."""
    code = ctypes.get_errno()
    return failure(what, code, lib.errormsg())


def failure(what: str, code: int, message: str) -> DeviceError:
    """The `DeviceError` of a failed PMDK call, from its errno and ``pmemobj_errormsg`` (read by
    whoever made the call: this binding, or the native library's worker threads)."""
    message = message or os.strerror(code)
    error = DeviceError(f"{what}: {message}")
    error.__cause__ = OSError(code, message)
    return error


def failure_errno(error: BaseException) -> int | None:
    """The errno of a `DeviceError` raised by this module (``None`` for any other error)."""
    cause = error.__cause__
    return cause.errno if isinstance(cause, OSError) else None


# Constructors are Python callables looked up by a token passed through PMDK's `void *arg`: one
# C trampoline serves every allocation, so no CFUNCTYPE is built (or kept alive) per call.
_pending: dict[int, tuple[Constructor, list[BaseException]]] = {}
_tokens = itertools.count(1)
_pending_lock = threading.Lock()


def _construct(pop: int | None, ptr: int | None, arg: int | None) -> int:
    # PMDK calls this with the GIL re-acquired by ctypes; an exception must not escape into C
    # (ctypes would only print it), so it is handed back to `Pool.alloc` and the allocation is
    # cancelled by a non-zero return, which PMDK reports as ECANCELED with nothing allocated.
    with _pending_lock:
        entry = _pending.get(arg or 0)
    if entry is None or ptr is None:
        return 1
    construct, errors = entry
    try:
        construct(ptr)
    except BaseException as exc:
        errors.append(exc)
        return 1
    return 0


_trampoline = C_CONSTRUCTOR(_construct)


class Pool:
    """One open pmemobj pool (`create_pool` / `open_pool`); `close` it exactly once, or more."""

    def __init__(self, lib: Lib, handle: int, path: Path) -> None:
        self._lib = lib
        self._handle: int | None = handle
        self.path = path
        self.size = path.stat().st_size if path.is_file() else 0
        # a forked child must not hold the pool's lock on (`tierkv._fork`)
        release_file_in_children(path, handle, self.size)

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise DeviceError(f"pmem pool {self.path} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """``pmemobj_close``; every address from `direct` is invalid afterwards."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._lib.obj.pmemobj_close(handle)
            keep_file(self.path)

    def is_pmem(self) -> bool:
        """libpmem's ``pmem_is_pmem`` over the whole mapping: real persistent memory or not."""
        return bool(self._lib.pmem.pmem_is_pmem(self.handle, self.size or MIN_POOL))

    # -- objects -------------------------------------------------------------------------------
    def root(self, size: int) -> Oid:
        """``pmemobj_root``: the root object, allocated zeroed (and persisted) on first use."""
        oid = self._lib.obj.pmemobj_root(self.handle, size)
        if oid.off == 0:
            raise _fail(self._lib, f"pmemobj_root({self.path})")
        return Oid(oid.pool_uuid_lo, oid.off)

    def root_size(self) -> int:
        return int(self._lib.obj.pmemobj_root_size(self.handle))

    def register_class(self, unit_size: int, units_per_block: int) -> int:
        """A new allocation class (``heap.alloc_class.new.desc``, runtime only); its id."""
        desc = AllocClassDesc(unit_size, 0, units_per_block, HEADER_COMPACT, 0)
        status = self._lib.obj.pmemobj_ctl_set(
            self.handle, b"heap.alloc_class.new.desc", ctypes.byref(desc)
        )
        if status != 0:
            raise _fail(self._lib, f"allocation class of {unit_size} B x {units_per_block}")
        return int(desc.class_id)

    def arena_count(self) -> int:
        count = ctypes.c_uint()
        if self._lib.obj.pmemobj_ctl_get(self.handle, b"heap.narenas.total", ctypes.byref(count)):
            raise _fail(self._lib, "heap.narenas.total")
        return int(count.value)

    def alloc(self, size: int, type_num: int, construct: Constructor, flags: int = 0) -> Oid:
        """``pmemobj_xalloc`` with a constructor: the object is published only if it returns.

        `flags` combines `class_flag` and `arena_flag` (0: PMDK's default classes, this
        thread's arena); with 0 this is exactly ``pmemobj_alloc``.

        `construct(address)` must fill and persist the `size` bytes at `address`; if it raises,
        PMDK rolls the allocation back and the exception propagates. A full pool raises
        `DeviceError` whose errno (`failure_errno`) is ``ENOMEM``.
        """
        token = next(_tokens)
        errors: list[BaseException] = []
        with _pending_lock:
            _pending[token] = (construct, errors)
        oid = PMEMoid()
        try:
            if flags:
                status = self._lib.obj.pmemobj_xalloc(
                    self.handle, ctypes.byref(oid), size, type_num, flags, _trampoline, token
                )
            else:
                status = self._lib.obj.pmemobj_alloc(
                    self.handle, ctypes.byref(oid), size, type_num, _trampoline, token
                )
            if status != 0:
                if errors:
                    raise errors[0]
                raise _fail(self._lib, f"pmemobj_alloc({size} bytes) in {self.path}")
        finally:
            with _pending_lock:
                del _pending[token]
        return Oid(oid.pool_uuid_lo, oid.off)

    def failure(self, what: str) -> DeviceError:
        """The `DeviceError` of a call on this pool that just failed in this thread, made by
        code outside this binding (the native put): errno and ``pmemobj_errormsg`` as `alloc`
        reports them."""
        return _fail(self._lib, f"{what} in {self.path}")

    def free(self, oid: Oid) -> None:
        """``pmemobj_free``: atomic; after a crash the object is either wholly there or gone."""
        self.handle  # noqa: B018 - raises when closed: freeing into an unmapped pool would crash
        self._lib.obj.pmemobj_free(ctypes.byref(oid.as_c()))

    def direct(self, oid: Oid) -> int:
        """The object's address in this process's mapping (valid until `close`)."""
        self.handle  # noqa: B018
        address = self._lib.held_obj.pmemobj_direct(oid.as_c())
        if not address:
            raise DeviceError(f"pmemobj_direct: {oid} is not an object of an open pool")
        return int(address)

    def first(self) -> Oid | None:
        """The first object of the pool (the root object excluded), or ``None``."""
        oid = self._lib.obj.pmemobj_first(self.handle)
        return Oid(oid.pool_uuid_lo, oid.off) if oid.off else None

    def next(self, oid: Oid) -> Oid | None:
        """The object after `oid` in the pool's walk order, or ``None`` at the end."""
        self.handle  # noqa: B018
        following = self._lib.obj.pmemobj_next(oid.as_c())
        return Oid(following.pool_uuid_lo, following.off) if following.off else None

    def type_num(self, oid: Oid) -> int:
        self.handle  # noqa: B018
        return int(self._lib.held_obj.pmemobj_type_num(oid.as_c()))

    def usable_size(self, oid: Oid) -> int:
        """Bytes the allocation really holds (its size class), ≥ the size asked for."""
        self.handle  # noqa: B018
        return int(self._lib.held_obj.pmemobj_alloc_usable_size(oid.as_c()))

    # -- persistence ---------------------------------------------------------------------------
    def persist(self, address: int, size: int) -> None:
        """Flush `size` bytes at `address` to the media (cache flush on pmem, msync otherwise)."""
        self._lib.obj.pmemobj_persist(self.handle, address, size)

    def memcpy_persist(self, dest: int, src: int | bytes, size: int) -> None:
        """Copy `size` bytes from `src` (an address, or a bytes object) to `dest` and persist."""
        self._lib.obj.pmemobj_memcpy_persist(self.handle, dest, src, size)

    def stream(self, dest: int, src: int, size: int) -> None:
        """Copy into the pool with non-temporal (streaming) stores and no fence.

        libpmem's ``pmem_memcpy(NONTEMPORAL | NODRAIN)``: the stores bypass the cache, so no
        cache line of the destination is read first and nothing is left to flush on real pmem.
        The caller `drain`s once after the last one and then `persist`s the whole range (the
        msync an emulated pool needs). ``pmemobj_memcpy`` is not used because on a pool that
        is not pmem PMDK 1.12 ignores its flags and copies with temporal stores plus an msync
        on every call.
        """
        self._lib.pmem.pmem_memcpy(dest, src, size, _STREAM_FLAGS)

    def drain(self) -> None:
        """``pmem_drain``: a store fence; streaming stores made so far are ordered before later
        stores (and, on real pmem, durable)."""
        self._lib.held_pmem.pmem_drain()


def set_prefault(*, at_create: bool, at_open: bool) -> None:
    """PMDK's global ``prefault.at_create`` / ``prefault.at_open``: touch every page of a pool
    as it is mapped (each byte is read and written back unchanged), so that page faults are
    paid once at open instead of on the data path."""
    lib = library()
    for name, value in ((b"prefault.at_create", at_create), (b"prefault.at_open", at_open)):
        flag = ctypes.c_int(int(value))
        if lib.obj.pmemobj_ctl_set(None, name, ctypes.byref(flag)) != 0:
            raise _fail(lib, name.decode())


def _encode_layout(layout: str) -> bytes:
    raw = layout.encode()
    if not raw or len(raw) >= MAX_LAYOUT or b"\x00" in raw:
        raise ValueError(f"a pmemobj layout name is 1..{MAX_LAYOUT - 1} bytes without NUL")
    return raw


def create_pool(path: Path, layout: str, size: int, mode: int = 0o600) -> Pool:
    """``pmemobj_create``: a new pool file of `size` bytes (0: use an existing file or device).

    PMDK refuses (``EEXIST``) to create over an existing file unless `size` is 0.
    """
    lib = library()
    handle = lib.obj.pmemobj_create(os.fsencode(path), _encode_layout(layout), size, mode)
    if not handle:
        raise _fail(lib, f"pmemobj_create({path})")
    return Pool(lib, int(handle), path)


def open_pool(path: Path, layout: str) -> Pool:
    """``pmemobj_open``; PMDK flocks the file: a pool held elsewhere fails ``EWOULDBLOCK``."""
    lib = library()
    handle = lib.obj.pmemobj_open(os.fsencode(path), _encode_layout(layout))
    if not handle:
        raise _fail(lib, f"pmemobj_open({path})")
    return Pool(lib, int(handle), path)
