"""Thread-pool backend: `os.preadv`/`os.pwritev` on worker threads, for kernels without io_uring.

Each call runs one blocking syscall loop on a `ThreadPoolExecutor` of `min(queue_depth, 16)`
workers; an `asyncio.Semaphore` bounds operations in flight to `queue_depth`. The buffer view is
taken on the loop thread and released when the call returns. A worker cannot be interrupted, so
a cancelled call waits for its worker before it raises (`outlive_cancel`): returning earlier
handed the buffer back to its pool while the worker still read into it.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tierkv._concurrency import outlive_cancel
from tierkv.tiers.nvme.io._aligned import AlignedBuffer
from tierkv.tiers.nvme.io._blockio import device_error, end_of_device, fdatasync

_MAX_WORKERS = 16


class ThreadIO:
    """`BlockIO` over a thread pool (see the module docstring)."""

    name = "threads"

    def __init__(self, fd: int, path: str, queue_depth: int) -> None:
        self._fd = fd
        self._path = path
        self._slots = asyncio.Semaphore(queue_depth)
        self._pool = ThreadPoolExecutor(
            max_workers=min(queue_depth, _MAX_WORKERS), thread_name_prefix="tierkv-nvme"
        )
        self._closed = False

    def _read(self, view: memoryview, offset: int) -> None:
        self._transfer("read", os.preadv, view, offset)

    def _write(self, view: memoryview, offset: int) -> None:
        self._transfer("write", os.pwritev, view, offset)

    def _transfer(
        self, op: str, call: Callable[[int, list[memoryview], int], int], view: memoryview,
        offset: int,
    ) -> None:
        """Move all of `view` with `call` (preadv/pwritev), resuming after short transfers."""
        done = 0
        while done < len(view):
            try:
                moved = call(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                code = exc.errno or errno.EIO
                raise device_error(op, self._path, code, offset + done) from exc
            if moved == 0:
                raise end_of_device(op, self._path, offset + done)
            done += moved

    async def _run(self, call: Callable[[memoryview, int], None], view: memoryview,
                   offset: int) -> None:
        loop = asyncio.get_running_loop()
        await outlive_cancel(loop.run_in_executor(self._pool, call, view, offset))

    async def read(self, buf: AlignedBuffer, offset: int, length: int) -> None:
        # No `with view`: the view must outlive any use by the worker.
        view = buf.view[:length]
        async with self._slots:
            await self._run(self._read, view, offset)

    async def write(self, buf: AlignedBuffer, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        view = buf.view[start : start + length]
        if urgent:  # still behind what the workers already hold, but not behind the semaphore
            await self._run(self._write, view, offset)
            return
        async with self._slots:
            await self._run(self._write, view, offset)

    async def sync(self) -> None:
        await fdatasync(self._fd, self._path)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
