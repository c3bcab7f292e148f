"""PMDK's two shared objects, loaded once, with the C types and prototypes of every call bound.

Separate from the binding's Python face (`_pmemobj`: `Pool` and the functions that open one)
because this is the C side of it: which libraries are loaded and how (their versioned names, the
API version checked, a second binding through `ctypes.PyDLL` for the calls that keep the GIL),
the structures C passes, and the argument and result types of each function, declared once, so
that a call made with the wrong types fails here rather than corrupting memory. The native copy
library reaches PMDK through the same loaded objects (`_native`), never a second copy.
"""

from __future__ import annotations

import ctypes
import functools

from tierkv.errors import DeviceError

LIBPMEMOBJ = "libpmemobj.so.1"
LIBPMEM = "libpmem.so.1"
#: PMDK 1.12 ships the libpmemobj API 2.4; 2.0 already has every call bound here
API_MAJOR = 2
API_MINOR = 0


class PMEMoid(ctypes.Structure):
    """``PMEMoid`` as C passes it: two uint64 by value."""

    _fields_ = (("pool_uuid_lo", ctypes.c_uint64), ("off", ctypes.c_uint64))


class AllocClassDesc(ctypes.Structure):
    """``struct pobj_alloc_class_desc``."""

    _fields_ = (
        ("unit_size", ctypes.c_size_t),
        ("alignment", ctypes.c_size_t),
        ("units_per_block", ctypes.c_uint),
        ("header_type", ctypes.c_int),
        ("class_id", ctypes.c_uint),
    )


HEADER_COMPACT = 1  # POBJ_HEADER_COMPACT: 16 bytes, keeps type_num and usable size

#: the C type of a constructor, ``int (*)(PMEMobjpool *pop, void *ptr, void *arg)``
C_CONSTRUCTOR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class Lib:
    """The two loaded libraries with argument and result types declared.

    `obj` and `pmem` release the GIL around each call; `held_obj` and `held_pmem` are the same
    libraries bound through `ctypes.PyDLL`, for the few nanosecond calls that keep it.
    """

    def __init__(self, obj: ctypes.CDLL, pmem: ctypes.CDLL) -> None:
        self.obj = obj
        self.pmem = pmem
        held_obj = ctypes.PyDLL(LIBPMEMOBJ)
        held_pmem = ctypes.PyDLL(LIBPMEM)
        self.held_obj = held_obj
        self.held_pmem = held_pmem
        c = ctypes
        sigs: list[tuple[ctypes.CDLL, str, object, list[object]]] = [
            (obj, "pmemobj_create", c.c_void_p, [c.c_char_p, c.c_char_p, c.c_size_t, c.c_uint]),
            (obj, "pmemobj_open", c.c_void_p, [c.c_char_p, c.c_char_p]),
            (obj, "pmemobj_close", None, [c.c_void_p]),
            (obj, "pmemobj_root", PMEMoid, [c.c_void_p, c.c_size_t]),
            (obj, "pmemobj_root_size", c.c_size_t, [c.c_void_p]),
            (obj, "pmemobj_alloc", c.c_int,
             [c.c_void_p, c.POINTER(PMEMoid), c.c_size_t, c.c_uint64, C_CONSTRUCTOR, c.c_void_p]),
            (obj, "pmemobj_xalloc", c.c_int,
             [c.c_void_p, c.POINTER(PMEMoid), c.c_size_t, c.c_uint64, c.c_uint64, C_CONSTRUCTOR,
              c.c_void_p]),
            (obj, "pmemobj_ctl_set", c.c_int, [c.c_void_p, c.c_char_p, c.c_void_p]),
            (obj, "pmemobj_ctl_get", c.c_int, [c.c_void_p, c.c_char_p, c.c_void_p]),
            (obj, "pmemobj_free", None, [c.POINTER(PMEMoid)]),
            (obj, "pmemobj_direct", c.c_void_p, [PMEMoid]),
            (obj, "pmemobj_first", PMEMoid, [c.c_void_p]),
            (obj, "pmemobj_next", PMEMoid, [PMEMoid]),
            (obj, "pmemobj_type_num", c.c_uint64, [PMEMoid]),
            (obj, "pmemobj_alloc_usable_size", c.c_size_t, [PMEMoid]),
            (obj, "pmemobj_persist", None, [c.c_void_p, c.c_void_p, c.c_size_t]),
            (obj, "pmemobj_memcpy_persist", c.c_void_p,
             [c.c_void_p, c.c_void_p, c.c_void_p, c.c_size_t]),
            (obj, "pmemobj_errormsg", c.c_char_p, []),
            (obj, "pmemobj_check_version", c.c_char_p, [c.c_uint, c.c_uint]),
            (pmem, "pmem_is_pmem", c.c_int, [c.c_void_p, c.c_size_t]),
            (pmem, "pmem_memcpy", c.c_void_p, [c.c_void_p, c.c_void_p, c.c_size_t, c.c_uint]),
            (pmem, "pmem_drain", None, []),
            (held_obj, "pmemobj_direct", c.c_void_p, [PMEMoid]),
            (held_obj, "pmemobj_type_num", c.c_uint64, [PMEMoid]),
            (held_obj, "pmemobj_alloc_usable_size", c.c_size_t, [PMEMoid]),
            (held_pmem, "pmem_drain", None, []),
        ]
        for lib, name, restype, argtypes in sigs:
            try:
                function = getattr(lib, name)
            except AttributeError as exc:
                raise DeviceError(f"{name} is missing from the installed PMDK: {exc}") from None
            function.restype = restype
            function.argtypes = argtypes

    def errormsg(self) -> str:
        raw = self.obj.pmemobj_errormsg()
        return raw.decode(errors="replace") if raw else ""


@functools.cache
def _load() -> Lib:
    try:
        obj = ctypes.CDLL(LIBPMEMOBJ, use_errno=True)
        pmem = ctypes.CDLL(LIBPMEM, use_errno=True)
    except OSError as exc:
        raise DeviceError(
            f"libpmemobj cannot be loaded ({exc}); install the Debian package libpmemobj1 "
            "(it brings libpmem1)"
        ) from None
    lib = Lib(obj, pmem)
    mismatch = obj.pmemobj_check_version(API_MAJOR, API_MINOR)
    if mismatch:
        raise DeviceError(f"{LIBPMEMOBJ} is too old: {mismatch.decode(errors='replace')}")
    return lib


def library() -> Lib:
    """The loaded libraries; `DeviceError` naming the package to install when they are absent."""
    return _load()
