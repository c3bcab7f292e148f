"""The pmem tier's large copies on the native library's worker threads, finished on the loop.

Separate from the tier because it is the asyncio side of `copy_queue.c`: a job (a prepared
`NativePut`, or a get's copy-and-verify) is submitted with one short C call; the workers run it
wholly in C, never taking the GIL; the loop watches the queue's eventfd (`add_reader`) and, on
each wake-up, reaps every job that has finished. Each job's `finish` runs on the loop when it
ends, before its future is resolved and whether or not the caller still waits, exactly as with
`_copythreads.CopyThreads` (which the Python copy path keeps using). `close` waits for every job.

Memory: a job's C structure and every buffer it reads or writes (the put's inputs, the get's
destination) stay referenced here from submit to reap, whatever happens to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.errors import DeviceError
from tierkv.tiers._copythreads import Finish, complete
from tierkv.tiers.pmem import _pmemobj as pmemobj
from tierkv.tiers.pmem._native import OP_GET, OP_PUT, Job, NativeCopies, NativePut

#: finished jobs taken per reap call
_REAP_BATCH = 64


@dataclass(slots=True)
class _Pending:
    job: Job
    future: asyncio.Future[Any]
    finish: Finish | None
    keep: object  # the NativePut, or the get's destination buffer


class NativeQueue:
    """Worker threads of the native library with an asyncio face (see the module docstring)."""

    def __init__(self, native: NativeCopies, loop: asyncio.AbstractEventLoop,
                 workers: int) -> None:
        self._native = native
        self._loop = loop
        handle = native.queue_create(workers)
        if not handle:
            code = ctypes.get_errno()
            raise DeviceError(f"cannot start {workers} native copy threads: "
                              f"{os.strerror(code)}")
        self._handle: int | None = handle
        self._eventfd = native.queue_eventfd(handle)
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._reaped = (ctypes.c_uint64 * _REAP_BATCH)()
        self._drained = asyncio.Event()
        self._drained.set()
        loop.add_reader(self._eventfd, self._reap)

    def put(self, put: NativePut, finish: Finish | None) -> asyncio.Future[Any]:
        """Run `put` on a worker; the future's result is `NativePut.outcome`'s tuple, or the
        allocation's `DeviceError`."""
        job = Job(op=OP_PUT, put=put.address)
        return self._submit(job, finish, put)

    def get(self, out: npt.NDArray[np.uint8], source: int, checksum: int,
            finish: Finish | None) -> asyncio.Future[Any]:
        """Fill `out` from `source` on a worker; the future's result is True when the bytes
        match `checksum`."""
        job = Job(op=OP_GET, dest=int(out.ctypes.data), src=source, len=out.nbytes,
                  expected=checksum)
        return self._submit(job, finish, out)

    def _submit(self, job: Job, finish: Finish | None, keep: object) -> asyncio.Future[Any]:
        if self._handle is None:
            raise DeviceError("the native copy queue is closed")
        future: asyncio.Future[Any] = self._loop.create_future()
        job.id = next(self._ids)
        self._pending[job.id] = _Pending(job, future, finish, keep)
        self._drained.clear()
        self._native.queue_submit(self._handle, ctypes.addressof(job))
        return future

    def _reap(self) -> None:
        # BlockingIOError: an earlier wake-up already reaped what signalled this one
        with contextlib.suppress(BlockingIOError):
            os.read(self._eventfd, 8)
        assert self._handle is not None
        while count := self._native.queue_reap(self._handle, self._reaped, _REAP_BATCH):
            for job_id in self._reaped[:count]:
                self._complete(self._pending.pop(job_id))
        if not self._pending:
            self._drained.set()

    @staticmethod
    def _complete(pending: _Pending) -> None:
        job = pending.job
        result: Any = None
        error: BaseException | None = None
        if job.op == OP_GET:
            result = bool(job.status)
        elif job.status == 0:
            put = pending.keep
            assert isinstance(put, NativePut)
            result = put.outcome(job.oid)
        else:
            put = pending.keep
            assert isinstance(put, NativePut)
            error = pmemobj.failure(put.what, job.error,
                                    job.message.decode(errors="replace"))
        complete(pending.future, pending.finish, result, error)

    async def close(self) -> None:
        """Wait for every job, then stop the workers and release the eventfd."""
        await self._drained.wait()
        if self._handle is not None:
            self._loop.remove_reader(self._eventfd)
            self._native.queue_destroy(self._handle)
            self._handle = None
