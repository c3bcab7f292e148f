"""Writing one object record into the pool: its size, and the job that allocates and fills it.

Separate from the tier because it is the write half of the record on media
(`formats.pmem_layout`): the Python path (`_copy.copy_in` inside a ctypes constructor) and the
native put (`_native.NativePut`, one C call) write the same bytes with the same guarantee (the
record is filled and persisted before PMDK publishes the allocation). The payload is hashed and
streamed in chunks (memory is read once, with non-temporal stores); the header, which holds the
checksum, is written after it at an offset sized for the widest checksum encoding (the payload
moves up in the 1-in-2**32 case of a shorter one). The tier decides where the job runs (inline,
on the Python copy thread, on the native workers) and keeps the books.
"""

from __future__ import annotations

import ctypes
import errno
import functools
from collections.abc import Callable
from dataclasses import dataclass

from tierkv.errors import DeviceError, TierFullError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.header import ObjectHeader, encode_header, encode_header_parts
from tierkv.formats.value import ObjectMeta
from tierkv.tiers._buffers import address_of
from tierkv.tiers.pmem import _pmemobj as pmemobj
from tierkv.tiers.pmem._copy import copy_in
from tierkv.tiers.pmem._native import NativeCopies, NativePut, Outcome
from tierkv.tiers.pmem._pool import PoolObject


@dataclass(frozen=True, slots=True)
class PreparedPut:
    """What a put allocates (`record_size` bytes), the job that writes it wherever it runs,
    and with the native library the put its workers can run instead (`_queue`)."""

    record_size: int
    write: Callable[[], PoolObject]
    native: NativePut | None


class RecordWriter:
    """Writes records into one open pool whose allocation classes are registered
    (`_pool.register_classes` gave `class_flags`); `native` is the loaded library or ``None``."""

    def __init__(self, pool: pmemobj.Pool, class_flags: list[int], native: NativeCopies | None,
                 tier_name: str) -> None:
        self._pool = pool
        self._class_flags = class_flags
        self._native = native
        self._name = tier_name

    def prepare(self, sequence: int, key: bytes, meta: ObjectMeta,
                view: memoryview) -> PreparedPut:
        """A put of `view` under `key`, numbered `sequence`, ready to run (nothing written)."""
        # the widest header (a checksum of 2**32 or more: all but 1 in 2**32) sizes the record
        parts = encode_header_parts(key, meta)
        native = self._native
        if native is None:
            size = layout.PREFIX_SIZE + parts.widest_size + view.nbytes
            write = functools.partial(self._write, sequence, key, meta, view, parts.widest_size)
            return PreparedPut(size, write, None)
        put = NativePut(native, self._pool.handle, prefix=layout.encode_prefix(sequence),
                        parts=parts, payload_address=address_of(view), payload_len=view.nbytes,
                        type_num=layout.OBJECT_TYPE_NUM, keep=view)
        put.set_flags(self._class_flag(put.record_size))
        write = functools.partial(self._write_native, put, meta, sequence)
        return PreparedPut(put.record_size, write, put)

    def _write(self, sequence: int, key: bytes, meta: ObjectMeta, view: memoryview,
               header_guess: int) -> PoolObject:
        """The Python path: allocate and fill one record.

        The payload is copied and hashed in `_copy.CHUNK`s (hashing the chunk just written,
        still in the cache), so memory is read about once; the header, which holds the checksum,
        is written after it, and the whole record is persisted once before PMDK publishes it.
        """
        pool = self._pool
        prefix = layout.encode_prefix(sequence)
        offset = len(prefix) + header_guess
        nbytes = view.nbytes
        written: list[int] = []

        def construct(address: int) -> None:
            payload_sum = copy_in(pool, address + offset, view)
            record = prefix + encode_header(ObjectHeader(key, meta, payload_sum))
            if len(record) != offset:  # a shorter checksum encoding: the payload moves up
                ctypes.memmove(address + len(record), address + offset, nbytes)
            ctypes.memmove(address, record, len(record))
            pool.persist(address, len(record) + nbytes)
            written.extend((payload_sum, len(record), address))

        size = offset + nbytes
        try:
            oid = pool.alloc(size, layout.OBJECT_TYPE_NUM, construct, self._class_flag(size))
        except DeviceError as exc:
            self.raise_if_full(exc, size)
            raise
        payload_sum, payload_offset, address = written
        return PoolObject(oid, address, meta, payload_offset, payload_sum,
                          pool.usable_size(oid) + layout.ALLOC_HEADER, sequence)

    def _write_native(self, put: NativePut, meta: ObjectMeta, sequence: int) -> PoolObject:
        """`_write` in one C call (`_native`): same record, same guarantees, no GIL."""
        try:
            outcome = put.run(self._pool)
        except DeviceError as exc:
            self.raise_if_full(exc, put.record_size)
            raise
        return self.pool_object(outcome, meta, sequence)

    def pool_object(self, outcome: Outcome, meta: ObjectMeta, sequence: int) -> PoolObject:
        """The record a native put wrote, as the tier indexes it."""
        oid, address, payload_offset, payload_sum = outcome
        return PoolObject(oid, address, meta, payload_offset, payload_sum,
                          self._pool.usable_size(oid) + layout.ALLOC_HEADER, sequence)

    def _class_flag(self, record_size: int) -> int:
        """The allocation flag of the tier's class for a record (0: a PMDK huge allocation)."""
        index = layout.class_index(record_size)
        return self._class_flags[index] if index is not None else 0

    def raise_if_full(self, error: DeviceError, size: int) -> None:
        """A failed allocation because the pool is full becomes `TierFullError` (the engine
        evicts and retries); any other failure stays what it is."""
        if pmemobj.failure_errno(error) == errno.ENOMEM:
            raise TierFullError(f"tier {self._name!r}: pool {self._pool.path} has no room for "
                                f"{size} bytes") from error
