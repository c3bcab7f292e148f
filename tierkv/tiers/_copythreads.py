"""Worker threads that run a tier's long copies off the event loop and finish them on it.

Separate from the pmem tier because it knows nothing about pools: it is a small job queue with
a loop-side completion step (`Finish`) that runs even when the awaiting caller was cancelled,
which is where a tier keeps its bookkeeping consistent.
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

#: what runs on the loop when a job ends: (result, error, abandoned: its caller was cancelled)
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


class CopyThreads:
    """Threads that run pool copies off the event loop (ctypes and xxhash release the GIL).

    Jobs go in through one `queue.SimpleQueue`; a thread that finds more jobs queued takes the
    next without sleeping. Results come back through `loop.call_soon_threadsafe`, but at most one
    such wake-up is pending at a time: results that finish meanwhile ride along with it.
    A job's `finish` runs on the loop when the job ends, before its future is resolved and
    whether or not the caller still waits (a cancelled caller cancels only its future): that is
    where the tier does its bookkeeping. `close` waits for every job submitted.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int, name: str) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._results: deque[tuple[_Job[Any], Any, BaseException | None]] = deque()
        self._lock = threading.Lock()
        self._posted = False
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, work: Callable[[], T], finish: Finish | None = None) -> asyncio.Future[T]:
        future: asyncio.Future[T] = self._loop.create_future()
        self._in_flight += 1
        self._drained.clear()
        self._jobs.put(_Job(work, future, finish))
        return future

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
            complete(job.future, job.finish, result, error)
        if not self._in_flight:
            self._drained.set()

    async def close(self) -> None:
        await self._drained.wait()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()  # each is past its last job: this returns at once
