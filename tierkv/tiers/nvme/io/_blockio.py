"""The small IO protocol both NVMe backends implement (io_uring ring, thread pool).

Offsets, lengths and buffer addresses handed to a backend are multiples of the tier's alignment
(the caller guarantees it; O_DIRECT refuses anything else with EINVAL). A call returns only when
the whole range was transferred: short transfers are continued, a transfer that cannot progress
(end of device) or a negative result becomes `DeviceError` carrying the errno. The buffer must
stay alive until the call returns, which the caller's reference guarantees; a cancelled call
returns (raising `CancelledError`) only once the kernel or worker stopped using the buffer, so
the caller may reuse it at once. At most
`queue_depth` operations are in flight per backend (plus any ``urgent`` writes); further calls wait
for a free slot.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Protocol

from tierkv.errors import DeviceError
from tierkv.tiers.nvme.io._aligned import AlignedBuffer


class BlockIO(Protocol):
    #: "io_uring" or "threads", for stats() and `tierkv info`
    name: str

    async def read(self, buf: AlignedBuffer, offset: int, length: int) -> None:
        """Read `length` bytes at device `offset` into the start of `buf`."""
        ...

    async def write(self, buf: AlignedBuffer, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        """Write `length` bytes from `buf[start:]` to device `offset`.

        ``urgent``: start at once, even beyond `queue_depth`, instead of waiting behind queued
        operations (for a small write everything else waits on).
        """
        ...

    async def sync(self) -> None:
        """Make completed writes durable on the device (fdatasync, off the event loop)."""
        ...

    async def aclose(self) -> None:
        """Wait for in-flight operations, then release the backend. Idempotent."""
        ...


def device_error(op: str, path: str, code: int, offset: int) -> DeviceError:
    """The `DeviceError` for a failed transfer; `errno` is set so callers can tell EIO/ENOSPC."""
    return DeviceError(f"{path}: {op} at offset {offset} failed: {os.strerror(code)}", errno=code)


def end_of_device(op: str, path: str, offset: int) -> DeviceError:
    return device_error(op, path, errno.EIO, offset)


async def fdatasync(fd: int, path: str) -> None:
    """fdatasync in the loop's default executor: it may block for milliseconds."""
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, os.fdatasync, fd)
    except OSError as exc:
        raise device_error("fdatasync", path, exc.errno or errno.EIO, 0) from exc
