"""Moving payload bytes between host buffers and pool memory, hashing them on the way.

The Python copy path: what the tier runs where the native library (`_native`) is not built;
`copy_out` also hands a get to the native library when it is. Separate from the tier because these
are the hot loops of put and get, tuned on their own (`CHUNK`; docs/benchmarks-pmem.md), and
because they run on the loop (small objects) or on the Python copy thread (large ones): they touch
only the memory they are given, never the tier's state.
"""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt
import xxhash

from tierkv.tiers._buffers import address_of
from tierkv.tiers.pmem import _pmemobj as pmemobj
from tierkv.tiers.pmem._native import NativeCopies

#: copy-and-hash granule: the chunk just copied is still in L2 (1 MiB per core on the test VM)
#: when hashed. 256 KiB chunks were ~8 % slower for 4 MiB objects (more Python per chunk) and
#: whole-object calls no faster than 1 MiB ones (docs/benchmarks-pmem.md)
CHUNK = 1 << 20


def pool_view(address: int, size: int) -> memoryview:
    """A view of pool memory; the caller drops it before the object is freed or the pool closed."""
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


def copy_in(pool: pmemobj.Pool, dest: int, view: memoryview) -> int:
    """Copy `nbytes` into the pool; the xxh3 of the bytes copied.

    Chunk by chunk (one chunk for objects up to `CHUNK`), the source is hashed and then streamed
    into the pool from the cache the hash just filled, so the source is read from memory once and
    no destination line is read at all (streaming stores). Each hash and copy is one C call that
    releases the GIL. The caller persists the record. A caller that changes its buffer during the
    put (against the contract) gets a checksum miss on get, never wrong bytes.
    """
    nbytes = view.nbytes
    if not nbytes:
        return xxhash.xxh3_64_intdigest(b"")
    source = address_of(view)
    if nbytes <= CHUNK:
        payload_sum = xxhash.xxh3_64_intdigest(view)
        pool.stream(dest, source, nbytes)
    else:
        digest = xxhash.xxh3_64()
        for start in range(0, nbytes, CHUNK):
            length = min(CHUNK, nbytes - start)
            digest.update(view[start : start + length])
            pool.stream(dest + start, source + start, length)
        payload_sum = digest.intdigest()
    pool.drain()
    return payload_sum


def copy_out(out: npt.NDArray[np.uint8], source: int, checksum: int,
             native: NativeCopies | None = None) -> memoryview | None:
    """Fill the caller-owned `out` from `source` (hashed chunk by chunk, one chunk for objects
    up to `CHUNK`); a view of it, or ``None`` when the bytes fail `checksum`. With `native`,
    one C call does it (`_pmem_native.NativeCopies.copy_verified`)."""
    nbytes = out.nbytes
    view = out.data
    target = address_of(out)
    if native is not None:
        return view if native.copy_verified(target, source, nbytes, checksum) else None
    if nbytes <= CHUNK:
        ctypes.memmove(target, source, nbytes)
        payload_sum = xxhash.xxh3_64_intdigest(view)
    else:
        digest = xxhash.xxh3_64()
        for start in range(0, nbytes, CHUNK):
            length = min(CHUNK, nbytes - start)
            ctypes.memmove(target + start, source + start, length)
            digest.update(view[start : start + length])
        payload_sum = digest.intdigest()
    return view if payload_sum == checksum else None
