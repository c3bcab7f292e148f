"""io_uring backend: one pyuring ring per tier, its fd watched by the event loop.

pyuring 0.3.0 gives what is needed without ctypes of our own:

* ``UringCtx.read_async_ptr`` / ``write_async_ptr(fd, address, length, offset, user_data)`` queue
  one SQE and submit it at once. We pass the address of a pooled `AlignedBuffer` (never `bytes`,
  which the library would copy for a read and lose the data).
* ``UringCtx.ring_fd`` is the ring's own fd; it polls readable while the completion queue holds
  entries, so `loop.add_reader` wakes us. ``peek_completion`` pops one CQE without blocking
  (``None`` when empty) and marks it seen.
* pyuring's `UringAsync.wait_completion` hands each completion to the *oldest* waiter whatever its
  user_data, so it is not used: `_drain` pops every available CQE on each wake-up and resolves the
  future registered under that CQE's user_data.

Buffers stay referenced in `_pending` until their CQE arrives. A caller cancelled while its
operation is in the kernel still waits for the completion before the cancellation propagates,
so the buffer it then returns to the pool is never written by the kernel afterwards. The ring is
used from the event loop thread only (pyuring's single-thread check stays on). An operation's
negative result becomes `DeviceError` with that errno; short transfers are continued.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
from typing import Any

from tierkv._platform import IORING_SETUP_SQPOLL
from tierkv.tiers.nvme.io._aligned import AlignedBuffer
from tierkv.tiers.nvme.io._blockio import device_error, end_of_device, fdatasync

log = logging.getLogger(__name__)

_USER_DATA_WRAP = 1 << 62


class _Op(enum.Enum):
    READ = "read"
    WRITE = "write"


#: reissues of one request that completed with -EAGAIN before it counts as a device error
_EAGAIN_RETRIES = 64


class UringIO:
    """`BlockIO` over io_uring (see the module docstring). Create it inside the running loop."""

    name = "io_uring"

    def __init__(self, fd: int, path: str, queue_depth: int, sq_poll: float | None = None) -> None:
        """`sq_poll`: seconds after which the kernel's submission-polling thread sleeps (the ring
        is set up with ``IORING_SETUP_SQPOLL``); ``None``: every submission enters the kernel."""
        import pyuring

        self._fd = fd
        self._path = path
        entries = 1 << max(1, (queue_depth - 1).bit_length())
        if sq_poll is not None:
            # the kernel thread frees an SQE only when it picks it up, so queued SQEs can add up
            # to every request in flight (queue_depth, plus an urgent one): leave room for them
            entries *= 2
        if sq_poll is None:
            self._ctx: Any = pyuring.direct.UringCtx(entries=entries)
        else:
            self._ctx = pyuring.direct.UringCtx(entries=entries, setup_flags=IORING_SETUP_SQPOLL,
                                                sq_thread_idle=max(1, round(sq_poll * 1000)))
        self.sq_poll = sq_poll
        self.eagain_retries = 0
        self._ring_fd: int = self._ctx.ring_fd
        self._loop = asyncio.get_running_loop()
        self._pending: dict[int, tuple[asyncio.Future[int], AlignedBuffer]] = {}
        self._next_user_data = 1
        self._slots = asyncio.Semaphore(queue_depth)
        self._loop.add_reader(self._ring_fd, self._drain)
        self._closed = False

    def _drain(self) -> None:
        while (cqe := self._ctx.peek_completion()) is not None:
            user_data, result = cqe
            entry = self._pending.pop(user_data, None)
            if entry is None:
                log.warning("io_uring completion for unknown user_data %d", user_data)
                continue
            future = entry[0]
            if not future.done():
                future.set_result(result)

    async def _one(self, op: _Op, buf: AlignedBuffer, start: int, offset: int, length: int) -> int:
        user_data = self._next_user_data
        self._next_user_data = user_data + 1 if user_data + 1 < _USER_DATA_WRAP else 1
        future: asyncio.Future[int] = self._loop.create_future()
        self._pending[user_data] = (future, buf)
        try:
            if op is _Op.READ:
                self._ctx.read_async_ptr(self._fd, buf.address + start, length, offset, user_data)
            else:
                self._ctx.write_async_ptr(self._fd, buf.address + start, length, offset, user_data)
        except OSError as exc:
            del self._pending[user_data]
            raise device_error(op.value, self._path, exc.errno or errno.EIO, offset) from exc
        cancelled = False
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                cancelled = True  # the kernel owns the buffer until the CQE: wait for it
        if cancelled:
            raise asyncio.CancelledError
        return future.result()

    async def _transfer(
        self, op: _Op, buf: AlignedBuffer, start: int, offset: int, length: int
    ) -> None:
        async with self._slots:
            await self._transfer_now(op, buf, start, offset, length)

    async def _transfer_now(
        self, op: _Op, buf: AlignedBuffer, start: int, offset: int, length: int
    ) -> None:
        done = 0
        retries = 0
        while done < length:
            result = await self._one(op, buf, start + done, offset + done, length - done)
            if result == -errno.EAGAIN and retries < _EAGAIN_RETRIES:
                # the kernel may complete a request it could not issue without blocking with
                # -EAGAIN (seen for O_DIRECT writes issued by the SQPOLL thread): issue it again
                retries += 1
                self.eagain_retries += 1
                continue
            if result < 0:
                raise device_error(op.value, self._path, -result, offset + done)
            if result == 0:
                raise end_of_device(op.value, self._path, offset + done)
            done += result

    async def read(self, buf: AlignedBuffer, offset: int, length: int) -> None:
        await self._transfer(_Op.READ, buf, 0, offset, length)

    async def write(self, buf: AlignedBuffer, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        if urgent:  # one SQE beyond queue_depth: the CQ ring (2x entries) still has room
            await self._transfer_now(_Op.WRITE, buf, start, offset, length)
        else:
            await self._transfer(_Op.WRITE, buf, start, offset, length)

    async def sync(self) -> None:
        await fdatasync(self._fd, self._path)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        waiting = [future for future, _buf in self._pending.values()]
        if waiting:
            await asyncio.wait(waiting)
        self._loop.remove_reader(self._ring_fd)
        self._ctx.close()
