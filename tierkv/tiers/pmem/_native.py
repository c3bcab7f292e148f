"""The pmem tier's native copy paths (tierkv/_native/pmem_copy.c), bound with ctypes.

`put` is one C call that runs ``pmemobj_xalloc`` with a C constructor: it hashes the payload and
streams it into the new allocation chunk by chunk, writes the record prefix and the header (whose
checksum it has just learnt) and persists the record once, all before PMDK publishes it, so the
crash guarantees of the Python path hold unchanged. `copy_verified` copies a payload out of the
pool and checks its checksum in the same pass. Neither touches the GIL for the whole copy, and
neither holds any Python object: the put's inputs are kept alive by the `NativePut` the caller
holds until the call returns.

The library is built at install time (setup.py) and is optional: `load` returns ``None`` when it
is absent and the tier keeps its Python path (`_copy`), saying so in `stats`/`describe`.
PMDK's functions are handed to the library as pointers from the binding already loaded
(`_pmemobj.library`), so it links against nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from tierkv.errors import DeviceError
from tierkv.formats import header
from tierkv.formats.header import HeaderParts
from tierkv.tiers._native import Job, QueueCalls, job_mismatch, library_path
from tierkv.tiers.pmem import _pmemobj as pmemobj

log = logging.getLogger(__name__)
#: what ``tkv_layout(i)`` must answer: the object-header facts pmem_copy.c mirrors, in its order
MIRRORED_LAYOUT = (
    ("header prefix size", header.PREFIX.size),
    ("header lead size", header.LEAD_SIZE),
    ("body length offset", header.BODY_LENGTH_OFFSET),
    ("body checksum offset", header.BODY_CHECKSUM_OFFSET),
    ("widest checksum encoding", header.WIDEST_CHECKSUM),
)


class _Api(ctypes.Structure):
    """``struct tkv_pmem_api``: the PMDK entry points the C constructor calls."""

    _fields_ = (
        ("xalloc", ctypes.c_void_p),
        ("persist", ctypes.c_void_p),
        ("pmem_memcpy", ctypes.c_void_p),
        ("pmem_drain", ctypes.c_void_p),
        ("errormsg", ctypes.c_void_p),
    )


class _Put(ctypes.Structure):
    """``struct tkv_put``: one put's inputs, and what the constructor reports back."""

    _fields_ = (
        ("api", ctypes.c_void_p),
        ("pop", ctypes.c_void_p),
        ("type_num", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("prefix", ctypes.c_char_p),
        ("prefix_len", ctypes.c_size_t),
        ("magic", ctypes.c_char_p),
        ("body_head", ctypes.c_char_p),
        ("body_head_len", ctypes.c_size_t),
        ("body_tail", ctypes.c_char_p),
        ("body_tail_len", ctypes.c_size_t),
        ("payload", ctypes.c_void_p),
        ("payload_len", ctypes.c_size_t),
        ("payload_sum", ctypes.c_uint64),
        ("payload_offset", ctypes.c_uint64),
        ("address", ctypes.c_uint64),
    )


#: what a native put reports: (oid, record address, payload offset, payload checksum)
Outcome = tuple[pmemobj.Oid, int, int, int]


class NativePut:
    """One prepared put (on the loop): `run` inline, or queued to the native workers
    (`_queue`). It owns every buffer the C code reads (`parts`, `prefix`, the caller's
    `payload` view) until the C call is done; the queue keeps it referenced until then."""

    __slots__ = ("_args", "_keep", "_lib", "record_size")

    def __init__(self, lib: NativeCopies, pool_handle: int, *, prefix: bytes,
                 parts: HeaderParts, payload_address: int, payload_len: int, type_num: int,
                 keep: object) -> None:
        self._lib = lib
        self._keep = (prefix, parts, keep)
        self._args = _Put(
            ctypes.addressof(lib.api), pool_handle, type_num, 0, prefix, len(prefix),
            parts.lead, parts.head, len(parts.head), parts.tail, len(parts.tail),
            payload_address, payload_len, 0, 0, 0)
        # the C code puts the payload behind the widest header, as the Python path does
        self.record_size = len(prefix) + parts.widest_size + payload_len

    def set_flags(self, flags: int) -> None:
        """``pmemobj_xalloc``'s flags (the allocation class), once `record_size` has chosen it."""
        self._args.flags = flags

    def run(self, pool: pmemobj.Pool) -> Outcome:
        """Allocate and fill the record: (oid, address, payload offset, payload checksum).

        A failing allocation raises `DeviceError` (errno ``ENOMEM``: the pool is full), as
        `pmemobj.Pool.alloc` does; nothing is allocated then.
        """
        oid = pmemobj.PMEMoid()
        if self._lib.put(ctypes.byref(self._args), ctypes.byref(oid)) != 0:
            raise pool.failure(self.what)
        return self.outcome(oid)

    @property
    def what(self) -> str:
        return f"pmemobj_xalloc({self.record_size} bytes)"

    @property
    def address(self) -> int:
        """The address of the C structure, for a queued job (`_queue`)."""
        return ctypes.addressof(self._args)

    def result_of(self, job: Job) -> Outcome:
        """What the queued put's `job` reports: `outcome`, or the allocation's `DeviceError`."""
        if job.status != 0:
            raise pmemobj.failure(self.what, job.error, job.message.decode(errors="replace"))
        return self.outcome(pmemobj.PMEMoid(*job.oid))

    def outcome(self, oid: pmemobj.PMEMoid) -> Outcome:
        """What `run` returns, once the C code has filled the record allocated as `oid`."""
        args = self._args
        return (pmemobj.Oid(oid.pool_uuid_lo, oid.off), int(args.address),
                int(args.payload_offset), int(args.payload_sum))


class NativeCopies:
    """The loaded library (see the module docstring); one per process, from `load`."""

    def __init__(self, library: ctypes.CDLL, pmdk: pmemobj.Lib) -> None:
        self.path = Path(library._name)
        address = functools.partial(ctypes.cast, typ=ctypes.c_void_p)
        self.api = _Api(
            address(pmdk.obj.pmemobj_xalloc).value,
            address(pmdk.obj.pmemobj_persist).value,
            address(pmdk.pmem.pmem_memcpy).value,
            address(pmdk.pmem.pmem_drain).value,
            address(pmdk.obj.pmemobj_errormsg).value,
        )
        self.put = library.tkv_pmem_put
        self.put.restype = ctypes.c_int
        self.put.argtypes = (ctypes.POINTER(_Put), ctypes.POINTER(pmemobj.PMEMoid))
        self._copy_verified = library.tkv_copy_verified
        self._copy_verified.restype = ctypes.c_int
        self._copy_verified.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_uint64)
        self.queue = QueueCalls(library)
        self.write_header = library.tkv_write_header  # the constructor's last step, for tests
        self.write_header.restype = ctypes.c_size_t
        self.write_header.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)
        self._xxh3 = library.tkv_xxh3_64
        self._xxh3.restype = ctypes.c_uint64
        self._xxh3.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

    def copy_verified(self, dest: int, source: int, nbytes: int, checksum: int) -> bool:
        """Copy `nbytes` from `source` to `dest`; True when they hash to `checksum`."""
        return bool(self._copy_verified(dest, source, nbytes, checksum))

    def xxh3_64(self, address: int, nbytes: int) -> int:
        """The library's xxh3-64 of `nbytes` at `address` (tests compare it with Python's)."""
        return int(self._xxh3(address, nbytes))


@functools.cache
def load() -> NativeCopies | None:
    """The native copy paths, or ``None`` (logged once) when the library is not built."""
    path = library_path()
    if path is None:
        log.warning("the native pmem copy library is not built (needs gcc and libxxhash-dev at "
                    "install time: scripts/setup); the pmem tier uses its slower Python path")
        return None
    try:
        library = ctypes.CDLL(str(path), use_errno=True)
    except OSError as exc:
        raise DeviceError(f"{path} cannot be loaded: {exc}") from None
    mismatch = abi_mismatch(library)
    if mismatch:
        log.warning("the native pmem copy library %s is stale (%s): rebuild it with "
                    "scripts/setup; the pmem tier uses its slower Python path", path, mismatch)
        return None
    return NativeCopies(library, pmemobj.library())


def abi_mismatch(library: ctypes.CDLL) -> str:
    """Why `library` does not match these bindings ('' when it does): another ABI version,
    structures of other sizes, or header layout facts (`MIRRORED_LAYOUT`) that differ from
    `formats.header`. A stale build would otherwise read and write past the structures Python
    hands it, or write records that recovery frees as corrupt."""
    mismatch = job_mismatch(library)
    if mismatch:
        return mismatch
    sizeof = library.tkv_sizeof
    for which, structure in enumerate((_Api, _Put)):
        if sizeof(which) != ctypes.sizeof(structure):
            return (f"struct {structure.__name__} is {sizeof(which)} bytes there and "
                    f"{ctypes.sizeof(structure)} here")
    try:
        mirrored = library.tkv_layout
    except AttributeError:
        return "it lacks tkv_layout"
    mirrored.restype, mirrored.argtypes = ctypes.c_uint64, (ctypes.c_int,)
    for which, (name, value) in enumerate(MIRRORED_LAYOUT):
        if mirrored(which) != value:
            return f"its {name} is {mirrored(which)}, formats/header.py says {value}"
    return ""
