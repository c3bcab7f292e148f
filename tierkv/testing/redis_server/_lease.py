"""What a test redis server holds, and how it gets and gives it back: free ports probed for it,
and the process and directory (`_Lease`) that a finalizer releases when a `RedisServer` is
never stopped.

Apart from the server class because the finalizer runs when the server object may be gone, so
what it releases must not reach back into the server: the lease is all it sees. `_PortTaken`
is the sign that another process bound a probed port first, on which the server tries a fresh
one.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import warnings
from pathlib import Path

from tierkv.testing.redis_server._resp import HOST


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports that nothing listened on a moment ago (all probes bound at once)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                  for _ in range(count)]
        for probe in probes:
            probe.bind((HOST, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


class _PortTaken(Exception):
    """The server exited because another process holds its port."""


class _Lease:
    """What a `RedisServer` holds: its process and directory (the finalizer's view of it)."""

    def __init__(self, directory: Path) -> None:
        self.directory: Path | None = directory
        self.process: subprocess.Popen[bytes] | None = None


def _release(lease: _Lease) -> None:
    """Finalizer of a `RedisServer` never stopped: kill its process, remove its directory."""
    if lease.process is not None and lease.process.poll() is None:
        warnings.warn(f"redis-server pid {lease.process.pid} was never stopped; killing it",
                      ResourceWarning, stacklevel=1)
        lease.process.kill()
        lease.process.wait()
    lease.process = None
    if lease.directory is not None:
        shutil.rmtree(lease.directory, ignore_errors=True)
        lease.directory = None


def _release_quietly(lease: _Lease) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        _release(lease)
