"""SIGTERM ends a CLI command the way Ctrl-C does: what the command set up is taken down.

Why: `tierkv bench` builds scratch media (pools on `/dev/shm`, which is RAM, and logs under
`/var/tmp`: 200 MB a trace point) and removes them on the way out. Ctrl-C unwinds to that
clean-up (`asyncio.run` cancels its main task on SIGINT); the default SIGTERM — `kill`, a
timeout, a job scheduler — ended the process at once and left them behind.

Within `terminable()`, a SIGTERM cancels the main task of the `run` in progress, so its
coroutines' clean-up runs, and `run` then raises `Terminated`; outside a `run` (or at a second
SIGTERM) it raises `Terminated` where the process is, so `with` and `finally` blocks unwind. The
CLI exits 143 (128 + SIGTERM), as a process killed by it would.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Coroutine, Iterator
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

#: what the CLI exits with when a SIGTERM ended the command
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(Exception):
    """The command was asked to end (SIGTERM) and has taken down what it set up."""


class _Watch:
    """The main task of the `run` in progress, and whether a SIGTERM cancelled it."""

    task: asyncio.Task[Any] | None = None
    cancelled = False


_watch = _Watch()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    task = _watch.task
    if task is not None and not task.done() and not _watch.cancelled:
        _watch.cancelled = True
        task.cancel()
        task.get_loop().call_soon_threadsafe(lambda: None)  # wake a loop blocked in select
        return
    raise Terminated("terminated by SIGTERM")


@contextlib.contextmanager
def terminable() -> Iterator[None]:
    """SIGTERM handled as the module docstring says, while inside (a command run off the main
    thread, where Python takes no signal handler, keeps the process's own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, whose main task a SIGTERM under `terminable` cancels: `Terminated`
    once its clean-up ran."""

    async def watched() -> T:
        _watch.task, _watch.cancelled = asyncio.current_task(), False
        return await main

    try:
        result = asyncio.run(watched())
    except asyncio.CancelledError:
        if not _watch.cancelled:
            raise
        raise Terminated("terminated by SIGTERM") from None
    finally:
        _watch.task = None
    if _watch.cancelled:  # the task took the cancellation in, and ended all the same
        raise Terminated("terminated by SIGTERM")
    return result
