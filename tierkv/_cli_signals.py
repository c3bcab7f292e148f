"""SIGINT and SIGTERM end a CLI command the same orderly way: what the command set up is taken
down, and the CLI exits 130 or 143 (128 + the signal), as a process killed by it would.

Why: `tierkv bench` builds scratch media (pools on `/dev/shm`, which is RAM, and logs under
`/var/tmp`: 200 MB a trace point) and removes them on the way out. The default SIGTERM — `kill`,
a timeout, a job scheduler — ended the process at once and left them behind.

Within `terminable()`, the first signal starts the shutdown: inside a `run`, it cancels the run's
main task, so its coroutines' clean-up runs, and `run` then raises `Terminated`; outside a `run`
it raises `Terminated` where the process is, so `with` and `finally` blocks unwind. Later signals
change nothing. An exception raised by a second signal lands in whatever frame happens to run:
a background move of the engine, or the clean-up itself, which may then wait forever for work
that will never finish (a second Ctrl-C under plain `asyncio.run` raises `KeyboardInterrupt` so,
and hung `tierkv bench` with its scratch media left behind). Nor does a signal ever raise inside
`run` (in the event loop's own code, between tasks): there it only cancels, or is noted for
`run` to raise once the loop is closed.
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

#: the signals that end a command
SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: what the CLI exits with when a SIGTERM ended the command (a SIGINT: 130)
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(Exception):
    """The command was asked to end (SIGINT or SIGTERM) and has taken down what it set up."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """128 + the signal, what a process the signal killed exits with."""
        return 128 + self.signum


class _Shutdown:
    """The first signal of the command, and the `run` in progress."""

    signum: int | None = None
    #: a `run` is in progress: a signal must not raise (the loop's own code may be running)
    running = False
    #: the main task of that run, once it started
    task: asyncio.Task[Any] | None = None
    #: set instead of cancelling `task` (`run`'s `stop`)
    stop: asyncio.Event | None = None


_state = _Shutdown()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _state.signum is not None:
        return  # the shutdown is under way; an exception now would land in arbitrary code
    _state.signum = signum
    if not _state.running:
        raise Terminated(signum)
    task = _state.task
    if task is None or task.done():
        return  # `run` raises `Terminated` once its loop is closed
    ending = _state.stop.set if _state.stop is not None else task.cancel
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: `run` raises
        task.get_loop().call_soon_threadsafe(ending)  # also wakes a loop blocked in select


@contextlib.contextmanager
def terminable() -> Iterator[None]:
    """SIGINT and SIGTERM handled as the module docstring says, while inside (a command run off
    the main thread, where Python takes no signal handler, keeps the process's own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.signum = None
    previous = {signum: signal.signal(signum, _on_signal) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _state.signum = None


def run(main: Coroutine[Any, Any, T], *, stop: asyncio.Event | None = None) -> T:
    """``asyncio.run(main)``, whose main task the first signal under `terminable` cancels:
    `Terminated` once its clean-up ran and the loop is closed. With `stop`, the signal sets
    `stop` instead: the command ends on its own, and `run` returns what it returned."""

    async def watched() -> T:
        _state.task = asyncio.current_task()
        if _state.signum is not None and stop is None:  # signalled while the loop started
            main.close()
            raise Terminated(_state.signum)
        if stop is not None and _state.signum is not None:
            stop.set()
        return await main

    _state.running, _state.task, _state.stop = True, None, stop
    try:
        result = asyncio.run(watched())
    except asyncio.CancelledError:
        if _state.signum is None:
            raise
        raise Terminated(_state.signum) from None
    except Exception:
        # what the signal cut short may fail rather than end cancelled (a helper process the
        # same Ctrl-C reached): the signal is the cause, and the user is told that, once
        if _state.signum is None or stop is not None:
            raise
        raise Terminated(_state.signum) from None
    finally:
        _state.running, _state.task, _state.stop = False, None, None
    if _state.signum is not None and stop is None:  # the task took the cancellation in
        raise Terminated(_state.signum)
    return result
