"""Large copies into and out of the slot pool on the CPU, on the native library's workers.

On the ``cpu`` device the pool is host memory and a copy is a memcpy. Done inline it holds the
event loop for the whole copy: a 1 MiB put took ~55 µs of the loop's ~90 µs per put, and in a
spill into the pmem tier the loop was the bottleneck. From `NATIVE_COPY_MIN` bytes the copy
runs on the native library's workers (`_native_queue`), which take no GIL, so the loop goes on
with other requests meanwhile; below it the hand-off (a submit, a wake-up, a reap: ~15-20 µs of
loop time on the bench VM) costs more than the copy. Without the library every copy stays
inline (`path` says which).

A copy's `finish` runs on the loop when the copy ends, whether or not its caller still waits:
that is where the tier gives back the slots of a put whose caller was cancelled, or the view
that kept a get's source slots reserved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from tierkv.tiers._native import load_queue
from tierkv.tiers._native_queue import NativeQueue

#: copies of this many bytes or more run on the workers. The hand-off costs the loop ~15-20 µs
#: on the bench VM, a 512 KiB memcpy ~25 µs: below it the loop would lose (docs/benchmarks.md)
NATIVE_COPY_MIN = 512 << 10
#: worker threads: two copies at once use both cores of the bench VM while the loop runs Python
WORKERS = 2
#: copies in flight at once; more wait for a slot (a get_many of many large objects)
DEPTH = 16


def address_of(array: npt.NDArray[np.uint8]) -> int:
    return int(array.ctypes.data)


class HostCopies:
    """The workers of one tier's pool, from open to close (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: NativeQueue | None = None

    def start(self) -> None:
        calls = load_queue()
        if calls is not None:
            self._queue = NativeQueue(calls, asyncio.get_running_loop(), WORKERS, DEPTH)

    async def close(self) -> None:
        """Wait for every copy begun (a cancelled caller's too), then stop the workers."""
        if self._queue is not None:
            await self._queue.close()
            self._queue = None

    def offloads(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` runs on the workers."""
        return self._queue is not None and nbytes >= NATIVE_COPY_MIN

    async def copy(self, destination: int, source: int, nbytes: int, keep: object,
                   ended: Callable[[bool], None]) -> None:
        """Copy `nbytes` from `source` to `destination` on a worker; `keep` holds both alive
        until the copy ends. `ended(completed)` runs on the loop exactly once, when the copy
        has ended (False: it failed or never ran, or its caller was cancelled: the copy is
        not the caller's any more), before this returns or raises."""
        assert self._queue is not None, "offloads() said the copy stays inline"

        def finish(result: object, error: BaseException | None, abandoned: bool) -> None:
            ended(error is None and not abandoned)

        await self._queue.copy(destination, source, nbytes, finish, keep)

    @property
    def path(self) -> str:
        if self._queue is None:
            return "inline"
        return f"native workers from {NATIVE_COPY_MIN >> 10} KiB"
