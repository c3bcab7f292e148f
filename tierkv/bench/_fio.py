"""fio runs the benchmarks start, and the stop of those still running when a bench is cut short.

A baseline runs fio from an executor thread (`tierkv.bench.nvme_baselines`); cancelling the task
that awaits it stops neither the thread nor fio. A bench stopped by a signal then removed its
scratch directory while fio still wrote its file there: fio created it again and the run left a
file of hundreds of MiB behind. Inside `fio_runs`, every fio started is killed and reaped when
the block ends, and none starts after.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Iterator

#: seconds fio has to stop its jobs and exit once told to, before it is killed
STOP_TIMEOUT = 10.0
_lock = threading.Lock()
_running: set[subprocess.Popen[str]] = set()
_stopped = False


def run_fio(command: list[str]) -> str:
    """Run fio (`command`), from any thread; its standard output.
    `subprocess.CalledProcessError` if it fails or was stopped, `subprocess.SubprocessError`
    if the `fio_runs` block it belongs to has ended."""
    with _lock:
        if _stopped:
            raise subprocess.SubprocessError("the benchmark was stopped: fio not started")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        _running.add(process)
    with process:
        try:
            out, err = process.communicate()
        finally:
            with _lock:
                _running.discard(process)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command, out, err)
    return out


@contextlib.contextmanager
def fio_runs() -> Iterator[None]:
    """A benchmark's span: at its end (cut short or not) every fio still running is killed,
    its job processes too, and waited for; none starts after."""
    global _stopped  # noqa: PLW0603 - the one switch every thread's `run_fio` reads
    with _lock:
        _stopped = False
    try:
        yield
    finally:
        with _lock:
            _stopped = True
        stop_running()


def stop_running() -> None:
    """Stop every fio running now (its job processes too) and wait for it."""
    with _lock:
        running = list(_running)
    # SIGTERM: fio stops the job processes it forked (each in a session of its own) and
    # exits; SIGKILL left them writing, holding the pipes open
    for process in running:
        process.terminate()
    for process in running:
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
