"""Large copies on the native library's worker threads, finished on the loop.

Separate from the tiers because it is the asyncio side of `copy_queue.c`, which two tiers use: a
job (the pmem tier's prepared put or its get's copy-and-verify; a plain copy into or out of the
gpu tier's host slots on the CPU) is submitted with one short C call, and the sleeping workers
the turn's jobs need are woken once, at the end of the loop turn; the workers run it wholly
in C, never taking the GIL; the loop watches the queue's eventfd (`add_reader`) and, on each
wake-up, reaps every job that has finished. Each job's `finish` runs on the loop when it ends,
before its future is resolved and whether or not the caller still waits, exactly as with
`_copythreads.CopyThreads` (which the Python copy paths keep using). `close` waits for every job.

Depth: at most `depth` jobs are in flight (`_copythreads.JobSlots`); a request beyond it waits
for the slot that the reap of an ended job gives back, so a get of 10,000 keys queues `depth`
jobs, not 10,000. A get's destination buffer is taken only once its slot is (`take_out`).

Memory: a job's C structure and every buffer it reads or writes (the put's inputs, the get's
destination, a copy's source and destination) stay referenced here from submit to reap, whatever
happens to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.errors import DeviceError
from tierkv.tiers._buffers import address_of
from tierkv.tiers._copythreads import Finish, JobSlots, complete
from tierkv.tiers._native import OP_COPY, OP_GET, OP_PUT, Job, QueueCalls

#: finished jobs taken per reap call
_REAP_BATCH = 64


#: what a put's end means, from its job (status, oid, error): the caller's result, or it raises
PutOutcome = Callable[[Job], Any]


@dataclass(slots=True)
class _Pending:
    job: Job
    future: asyncio.Future[Any]
    finish: Finish | None
    keep: object  # every buffer the job reads or writes
    outcome: PutOutcome | None = None  # a put's


class NativeQueue:
    """Worker threads of the native library with an asyncio face (see the module docstring)."""

    def __init__(self, calls: QueueCalls, loop: asyncio.AbstractEventLoop,
                 workers: int, depth: int) -> None:
        self._calls = calls
        self._loop = loop
        handle = calls.create(workers)
        if not handle:
            code = ctypes.get_errno()
            raise DeviceError(f"cannot start {workers} native copy threads: "
                              f"{os.strerror(code)}")
        self._handle: int | None = handle
        self._eventfd = calls.eventfd(handle)
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._reaped = (ctypes.c_uint64 * _REAP_BATCH)()
        self._slots = JobSlots(loop, depth)
        #: the most jobs ever submitted and not yet reaped at once (bounded by `depth`)
        self.max_in_flight = 0
        #: a kick of the workers is due at the end of this loop turn (`_submit`)
        self._kick_due = False
        loop.add_reader(self._eventfd, self._reap)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def waiting(self) -> int:
        return self._slots.waiting

    async def put(self, address: int, outcome: PutOutcome, finish: Finish | None,
                  keep: object) -> Any:
        """Run the pmem put whose C structure is at `address` (kept alive by `keep`) on a worker
        once a slot is free: what `outcome` makes of its job, or what it raises. `finish` runs
        exactly once, as in `CopyThreads.run`."""
        await self._slots.admit(finish)
        return await self._submit(Job(op=OP_PUT, put=address), finish, keep, outcome)

    async def get(self, take_out: Callable[[], npt.NDArray[np.uint8]], source: int,
                  checksum: int, finish: Finish | None) -> npt.NDArray[np.uint8] | None:
        """Once a slot is free, fill the buffer ``take_out()`` returns then from `source` on a
        worker (its size is the copy's); that buffer, or ``None`` when the bytes fail
        `checksum`. `finish` runs exactly once, as in `CopyThreads.run`."""
        await self._slots.admit(finish)
        try:
            out = take_out()
        except BaseException as exc:
            self._slots.refuse(finish, exc)
            raise
        job = Job(op=OP_GET, dest=address_of(out), src=source, len=out.nbytes,
                  expected=checksum)
        matched = await self._submit(job, finish, out)
        return out if matched else None

    async def copy(self, destination: int, source: int, nbytes: int, finish: Finish | None,
                   keep: object) -> None:
        """Copy `nbytes` from `source` to `destination` on a worker once a slot is free; `keep`
        holds whatever keeps both alive. `finish` runs exactly once, as in `CopyThreads.run`."""
        await self._slots.admit(finish)
        await self._submit(Job(op=OP_COPY, dest=destination, src=source, len=nbytes), finish,
                           keep)

    def _submit(self, job: Job, finish: Finish | None, keep: object,
                outcome: PutOutcome | None = None) -> asyncio.Future[Any]:
        """Queue `job` under the slot just taken; the reap of its end gives the slot back."""
        if self._handle is None:
            error = DeviceError("the native copy queue is closed")
            self._slots.refuse(finish, error)
            raise error
        future: asyncio.Future[Any] = self._loop.create_future()
        job.id = next(self._ids)
        self._pending[job.id] = _Pending(job, future, finish, keep, outcome)
        self.max_in_flight = max(self.max_in_flight, len(self._pending))
        self._calls.submit(self._handle, ctypes.addressof(job))
        if not self._kick_due:
            # one wake-up of the workers for every job this turn submits: each submit's own
            # (a futex call) cost the loop ~10 us where a worker slept (docs/benchmarks.md)
            self._kick_due = True
            self._loop.call_soon(self._kick)
        return future

    def _kick(self) -> None:
        self._kick_due = False
        if self._handle is not None:
            self._calls.kick(self._handle)

    def _reap(self) -> None:
        # BlockingIOError: an earlier wake-up already reaped what signalled this one
        with contextlib.suppress(BlockingIOError):
            os.read(self._eventfd, 8)
        assert self._handle is not None
        while count := self._calls.reap(self._handle, self._reaped, _REAP_BATCH):
            for job_id in self._reaped[:count]:
                self._slots.give_back()
                self._complete(self._pending.pop(job_id))

    @staticmethod
    def _complete(pending: _Pending) -> None:
        job = pending.job
        result: Any = None
        error: BaseException | None = None
        if pending.outcome is not None:
            try:
                result = pending.outcome(job)
            except Exception as exc:  # the put's DeviceError, or a defect: the caller's either way
                error = exc
        elif job.status < 0:  # an operation the library does not know: a stale build
            error = DeviceError(f"the native copy library refused job {job.op}: "
                                f"{os.strerror(job.error)}")
        else:
            result = bool(job.status)
        complete(pending.future, pending.finish, result, error)

    async def close(self) -> None:
        """Wait for every job, then stop the workers and release the eventfd."""
        await self._slots.idle.wait()
        if self._handle is not None:
            self._loop.remove_reader(self._eventfd)
            self._calls.destroy(self._handle)
            self._handle = None
