"""Worker threads that run a tier's long copies off the event loop and finish them on it.

Separate from the pmem tier because it knows nothing about pools: it is a small job queue with
a loop-side completion step (`Finish`) that runs even when the awaiting caller was cancelled,
which is where a tier keeps its bookkeeping consistent, and a bound on the jobs in flight
(`JobSlots`) that any such queue can own.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: what runs on the loop when a job ends: (result, error, abandoned: its caller was cancelled).
#: A request cancelled while it waited for a slot ends there too, never having run:
#: ``finish(None, CancelledError(), True)``, so the caller's bookkeeping has one exit
Finish = Callable[[Any, BaseException | None, bool], None]


@dataclass(frozen=True, slots=True)
class _Job(Generic[T]):
    work: Callable[[], T]
    future: asyncio.Future[T]
    finish: Finish | None


def complete(future: asyncio.Future[Any], finish: Finish | None, result: Any,
             error: BaseException | None) -> None:
    """End a job on the loop: its `finish` first (told whether the caller was cancelled), then
    its future, unless cancelled; a failing `finish` becomes the caller's error."""
    try:
        if finish is not None:
            finish(result, error, future.cancelled())
    except BaseException as exc:  # a bookkeeping failure goes to the caller
        error = exc
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class JobSlots:
    """At most `limit` jobs in flight on one queue; requests beyond it wait, first come first
    served. A counter and the waiters' futures, owned by the queue: the queue takes a slot as it
    submits a job (`take`) and gives it back where the job *ends*, on the loop (`give_back`),
    never in its caller, which may be cancelled while the job still runs on a worker.

    A slot given back goes straight to the oldest live waiter, so `in_flight < limit` only
    while nobody waits. A waiter cancelled before its slot came leaves nothing behind (its
    future is skipped when it reaches the front); one cancelled in the step its slot came
    passes the slot on. `idle` is set while no slot is held. Loop thread only.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a queue depth of {limit}: at least one job must fit")
        self._loop = loop
        self.limit = limit
        self.in_flight = 0
        self.waiting = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.idle = asyncio.Event()
        self.idle.set()

    async def take(self) -> None:
        """Return holding a slot, after waiting for one when all `limit` are taken."""
        if self.in_flight < self.limit:
            self.in_flight += 1
            self.idle.clear()
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        self.waiting += 1
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_back()  # handed a slot in the same step as cancelled: pass it on
            else:
                waiter.cancel()  # skipped from now on, and dropped once at the front
                self.waiting -= 1
                while self._waiters and self._waiters[0].done():
                    self._waiters.popleft()
            raise

    async def admit(self, finish: Finish | None) -> None:
        """`take` for a request whose `finish` must run exactly once: a caller cancelled while
        it waits ends the request here, never having run (see `Finish`)."""
        try:
            await self.take()
        except asyncio.CancelledError as exc:
            if finish is not None:
                finish(None, exc, True)
            raise

    def refuse(self, finish: Finish | None, error: BaseException) -> None:
        """End an admitted request that could not be submitted: its slot back, its `finish`
        told `error`."""
        self.give_back()
        if finish is not None:
            finish(None, error, False)

    def give_back(self) -> None:
        """The slot of a job that ended (or of a waiter that never used it)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled waiter's future is done: skip it
                self.waiting -= 1
                waiter.set_result(None)
                return
        self.in_flight -= 1
        if not self.in_flight:
            self.idle.set()


class CopyThreads:
    """Threads that run pool copies off the event loop (ctypes and xxhash release the GIL).

    Jobs go in through one `queue.SimpleQueue`; a thread that finds more jobs queued takes the
    next without sleeping. Results come back through `loop.call_soon_threadsafe`, but at most one
    such wake-up is pending at a time: results that finish meanwhile ride along with it.
    At most `depth` jobs are in flight (`JobSlots`); `run` waits for a slot first.
    A job's `finish` runs on the loop when the job ends, before its future is resolved and
    whether or not the caller still waits (a cancelled caller cancels only its future): that is
    where the tier does its bookkeeping. `close` waits for every job submitted.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int, name: str,
                 depth: int) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._results: deque[tuple[_Job[Any], Any, BaseException | None]] = deque()
        self._lock = threading.Lock()
        self._posted = False
        self._slots = JobSlots(loop, depth)
        self._in_flight = 0
        #: the most jobs ever submitted and not yet ended at once (bounded by `depth`)
        self.max_in_flight = 0
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return self._slots.waiting

    async def run(self, start: Callable[[], Callable[[], T]], finish: Finish | None = None) -> T:
        """Run a job on a thread once a slot is free; its result (or its error).

        `start` runs on the loop once the slot is taken and returns the work for the thread, so
        that what the work needs (a get's result buffer) exists only for jobs in flight, not for
        every waiting request. A caller cancelled while it waits ends the job at once (see
        `Finish`); `start` and the work never run then. `finish` runs exactly once.
        """
        await self._slots.admit(finish)
        try:
            work = start()
        except BaseException as exc:
            self._slots.refuse(finish, exc)
            raise
        future: asyncio.Future[T] = self._loop.create_future()
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        self._jobs.put(_Job(work, future, finish))
        return await future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                result, error = job.work(), None
            except BaseException as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            self._results.append((job, result, error))
            with self._lock:
                post, self._posted = not self._posted, True
            if post:
                self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            self._posted = False
        while self._results:
            job, result, error = self._results.popleft()
            self._in_flight -= 1
            self._slots.give_back()
            complete(job.future, job.finish, result, error)

    async def close(self) -> None:
        await self._slots.idle.wait()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()  # each is past its last job: this returns at once
