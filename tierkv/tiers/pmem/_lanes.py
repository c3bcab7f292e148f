"""Where the pmem tier's copies run: inline, on the Python copy thread, or on the native workers.

Separate from the tier because it is the mechanism under the data path, not its bookkeeping:
which queue a large copy takes (the native library's workers where it is built and loads, else
the Python copy thread, which runs the open-time walk in both cases), how a get's bytes come out
(straight into the caller's `bytes`, or into a recycled buffer), how many copies are in flight,
and the wait for them at close. The tier decides what a copy's end means for its index and
`used`, in the `finish` it hands over: that runs on the loop when the copy ends, whether or not
the caller still waits (`_copythreads.Finish`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from tierkv.errors import DeviceError
from tierkv.formats.value import ObjectMeta, Payload, ValueKind
from tierkv.tiers._buffers import BufferRecycler, fresh_bytes
from tierkv.tiers._copythreads import CopyThreads, Finish
from tierkv.tiers._native_queue import NativeQueue
from tierkv.tiers.pmem._copy import copy_out
from tierkv.tiers.pmem._native import NativeCopies, Outcome
from tierkv.tiers.pmem._native import load as load_native
from tierkv.tiers.pmem._pool import PoolObject
from tierkv.tiers.pmem._records import PreparedPut, RecordWriter

T = TypeVar("T")

#: payloads of this many bytes or more are copied on the worker thread, off the event loop
LARGE_COPY = 64 << 10
#: threads that run large copies (and the recovery walk). On the 2-vCPU test VM two threads
#: were no faster than one with 8 requests in flight, and gets were slower (three threads
#: contending for the GIL and two cores; docs/benchmarks-pmem.md)
COPY_THREADS = 1
#: worker threads of the native library. Its workers never take the GIL, so unlike the Python
#: copy threads two of them scale on the 2-vCPU test VM: with 8 requests in flight, 4 MiB gets
#: went from 0.50 to 0.81-0.84 of memcpy and 256 KiB ones from 0.41 to 0.82 (one run, A/B/A;
#: docs/benchmarks-pmem.md)
NATIVE_WORKERS = 2
#: memory of dropped get results kept for reuse (`_buffers`): 8 requests in flight of 4 MiB,
#: twice over
RETAINED_RESULTS = 64 << 20

#: what a large put's `finish` is told: the record written (or ``None``), the error, whether
#: its caller was cancelled
PutFinish = Callable[[PoolObject | None, BaseException | None, bool], None]


class CopyLanes:
    """The copy queues of one pmem tier, from open to close (see the module docstring).

    `queue_depth` bounds the large copies in flight on either queue; `use_native` False keeps
    the Python copy path even where the native library is built.
    """

    def __init__(self, name: str, queue_depth: int, *, use_native: bool) -> None:
        self._name = name
        self._depth = queue_depth
        self._use_native = use_native
        self.native: NativeCopies | None = None
        self._native_queue: NativeQueue | None = None
        self._copy_threads: CopyThreads | None = None
        self._results = BufferRecycler(RETAINED_RESULTS)
        self._max_in_flight = 0  # of the queues closed so far (`stats`)
        self._operations = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle -------------------------------------------------------------------------------
    def load_native(self) -> NativeCopies | None:
        """The native library, when this tier may use it and it is built; ``None`` otherwise.
        Called by the open-time walk, on the copy thread."""
        self.native = load_native() if self._use_native else None
        return self.native

    async def start(self, walk: Callable[[], T]) -> T:
        """Run `walk` (the open) on a Python copy thread, then keep the queue large copies
        take: that thread, or the native workers where `walk` loaded the library."""
        loop = asyncio.get_running_loop()
        copier = CopyThreads(loop, COPY_THREADS, f"tierkv-{self._name}-pmem", self._depth)
        try:
            opened = await copier.run(lambda: walk)
        except BaseException:
            await copier.close()
            raise
        if self.native is None:
            self._copy_threads = copier
        else:  # the native workers take every large copy: the Python thread was for the walk
            await copier.close()
            self._native_queue = NativeQueue(self.native.queue, loop, NATIVE_WORKERS,
                                             self._depth)
        return opened

    async def close(self) -> None:
        """Wait until every operation begun has ended (`begin`/`end`), then stop the queue."""
        await self._idle.wait()
        if self._native_queue is not None:
            await self._native_queue.close()
            self._max_in_flight = max(self._max_in_flight, self._native_queue.max_in_flight)
            self._native_queue = None
        if self._copy_threads is not None:
            await self._copy_threads.close()
            self._max_in_flight = max(self._max_in_flight, self._copy_threads.max_in_flight)
            self._copy_threads = None

    def begin(self) -> None:
        """An operation whose copy may outlive its caller started; `close` waits for its `end`."""
        self._operations += 1
        self._idle.clear()

    def end(self) -> None:
        self._operations -= 1
        if not self._operations:
            self._idle.set()

    # -- copies ----------------------------------------------------------------------------------
    async def write(self, prepared: PreparedPut, writer: RecordWriter, meta: ObjectMeta,
                    sequence: int, finish: PutFinish) -> None:
        """Write a large put's record on the active queue; `finish` gets the record."""
        native_put = prepared.native
        if native_put is None:
            await self._copier().run(lambda: prepared.write, finish)
            return

        def finish_native(outcome: Outcome | None, error: BaseException | None,
                          abandoned: bool) -> None:
            obj = None if outcome is None else writer.pool_object(outcome, meta, sequence)
            finish(obj, error, abandoned)

        try:
            await self._queue().put(native_put.address, native_put.result_of, finish_native,
                                    native_put)
        except DeviceError as exc:
            writer.raise_if_full(exc, prepared.record_size)
            raise

    async def read(self, obj: PoolObject, finish: Finish) -> Payload | None:
        """`obj`'s payload as the caller will own it, or ``None`` when it fails its checksum.

        Inline below `LARGE_COPY` (`finish` runs before this returns), else on the active queue.
        """
        source, nbytes = obj.address + obj.payload_offset, obj.meta.nbytes
        # bytes values are copied straight into the `bytes` the caller gets, tensors into a
        # recycled buffer; a large get takes it only once its copy has a slot in the queue
        result: list[bytes] = []

        def take_out() -> npt.NDArray[np.uint8]:
            if obj.meta.kind is not ValueKind.BYTES:
                return self._results.take(nbytes)
            fresh, array = fresh_bytes(nbytes)
            result.append(fresh)
            return array

        copied: memoryview | npt.NDArray[np.uint8] | None
        if nbytes < LARGE_COPY:
            try:
                copied = copy_out(take_out(), source, obj.payload_checksum, self.native)
            finally:
                finish(None, None, False)
        elif self.native is None:
            copied = await self._copier().run(
                lambda: functools.partial(copy_out, take_out(), source, obj.payload_checksum),
                finish)
        else:
            copied = await self._queue().get(take_out, source, obj.payload_checksum, finish)
        if copied is None:
            return None
        return result[0] if result else (copied.data if isinstance(copied, np.ndarray)
                                         else copied)

    def _queue(self) -> NativeQueue:
        assert self._native_queue is not None  # open, with the native library
        return self._native_queue

    def _copier(self) -> CopyThreads:
        assert self._copy_threads is not None  # open on the Python copy path
        return self._copy_threads

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, str | int]:
        """The copy path, the large copies on the active queue (in flight, waiting for a slot,
        and the most ever in flight at once: never above `queue_depth`), recycled results."""
        active = self._native_queue or self._copy_threads
        if active is None:
            copies = {"copies_in_flight": 0, "copies_waiting": 0,
                      "copies_in_flight_max": self._max_in_flight}
        else:
            copies = {"copies_in_flight": active.in_flight, "copies_waiting": active.waiting,
                      "copies_in_flight_max": max(self._max_in_flight, active.max_in_flight)}
        return {"copy_path": self.copy_path(), **copies,
                "recycled_results": self._results.reused}

    def copy_path(self) -> str:
        if self.native is not None:
            return f"native ({self.native.path.name})"
        return "python" + ("" if not self._use_native else " (native library not built)")
