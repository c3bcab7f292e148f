"""Large copies into and out of the slot pool on the CPU, on the native library's workers.

On the ``cpu`` device the pool is host memory and a copy is a memcpy. Done inline it holds the
event loop for the whole copy: a 1 MiB put took ~55 µs of the loop's ~90 µs per put, and in a
spill into the pmem tier the loop was the bottleneck. From `NATIVE_COPY_MIN` bytes the copy
runs on the native library's workers (`_native_queue`), which take no GIL, so the loop goes on
with other requests meanwhile; below it the hand-off (a submit, a wake-up, a reap: ~15-20 µs of
loop time on the bench VM) costs more than the copy. Without the library every copy stays
inline (`path` says which).

A hand-off only pays when the loop has other work to do while the worker copies (other
requests' bookkeeping, in an engine serving many tasks). A lone caller that puts and gets one
object after another waits for the worker's wake-up and for its own (two futex wake-ups and an
eventfd, tens of µs on the bench VM) with the loop idle: its 2 MiB put+get fell from 0.70 to 0.35
of memcpy. So the tier keeps a gauge of whether its copies overlapped other work (`LoopOverlap`):
a copy did when another copy ran beside it (many callers: the workers copy in parallel, even
where they, not the loop, are the limit), else by how busy the loop stayed meanwhile (its CPU
time over the copy's wall time, which the copy's own hand-off keeps near half). Below
`BUSY_ENOUGH`, large copies run inline
too, and one every `PROBE_INTERVAL` still goes to the workers to see whether that changed (a
probe costs a lone caller several inline copies' time: one per interval bounds that to about a
percent, and a server whose load grows finds the workers again within the interval). That is
the tier's ``host_copies = "auto"``; ``"workers"`` and ``"inline"`` fix the choice.

A copy's `finish` runs on the loop when the copy ends, whether or not its caller still waits:
that is where the tier gives back the slots of a put whose caller was cancelled, or the view
that kept a get's source slots reserved.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tierkv.config import HostCopies as Mode
from tierkv.tiers._native import load_queue
from tierkv.tiers._native_queue import NativeQueue

#: copies of this many bytes or more run on the workers. The hand-off costs the loop ~15-20 µs
#: on the bench VM, a 512 KiB memcpy ~25 µs: below it the loop would lose (docs/benchmarks.md)
NATIVE_COPY_MIN = 512 << 10
#: worker threads: two copies at once use both cores of the bench VM while the loop runs Python
WORKERS = 2
#: copies in flight at once; more wait for a slot (a get_many of many large objects)
DEPTH = 16
#: the loop's busy share during offloaded copies above which large copies keep going to the
#: workers. A lone copy's own hand-off (the kick's futex call, the eventfd read, the reap) keeps
#: the loop busy for 0.30-0.73 of a 1 MiB copy on the bench VM (median 0.45, 600 copies), so a
#: loop that did nothing else must read as idle below this
BUSY_ENOUGH = 0.8
#: seconds between probes while large copies run inline: one goes to the workers all the same
PROBE_INTERVAL = 0.05
#: the gauge's memory, in copies: one copy's share moves it by 1/WEIGHT
WEIGHT = 8


class LoopOverlap:
    """Whether offloaded copies overlapped other work: per copy, 1 where another copy ran
    beside it, else the loop's CPU time over the copy's wall time (1: it worked all along, 0:
    it slept waiting for the copy); averaged over the last `WEIGHT`-odd copies while they go to
    the workers, so that a copy alone now and then (the last of a burst) does not send the
    next burst inline, and taken as it is from a probe, a fresh look after a pause."""

    __slots__ = ("_next_probe", "_probing", "busy")

    def __init__(self) -> None:
        self.busy = 1.0  # offload until measured otherwise: a server starts with its load
        self._next_probe = 0.0
        self._probing = False

    def offload(self) -> bool:
        """Whether the next large copy goes to the workers: yes while the loop stays busy,
        else one every `PROBE_INTERVAL`."""
        if self.busy >= BUSY_ENOUGH:
            return True
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + PROBE_INTERVAL
        self._probing = True
        return True

    def measured(self, loop_cpu: float, wall: float) -> None:
        share = min(loop_cpu / wall, 1.0) if wall > 0 else self.busy
        if self._probing:
            self._probing = False
            self.busy = share
        else:
            self.busy += (share - self.busy) / WEIGHT


class HostCopies:
    """The workers of one tier's pool, from open to close (see the module docstring)."""

    def __init__(self, mode: Mode) -> None:
        self._mode = mode
        self._queue: NativeQueue | None = None
        self.overlap = LoopOverlap()
        self._submitted = 0  # copies submitted so far

    def start(self) -> None:
        calls = None if self._mode is Mode.INLINE else load_queue()
        if calls is not None:
            self._queue = NativeQueue(calls, asyncio.get_running_loop(), WORKERS, DEPTH)

    async def close(self) -> None:
        """Wait for every copy begun (a cancelled caller's too), then stop the workers."""
        if self._queue is not None:
            await self._queue.close()
            self._queue = None

    def offloads(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` runs on the workers (then the caller must `copy` it)."""
        return (self._queue is not None and nbytes >= NATIVE_COPY_MIN
                and (self._mode is Mode.WORKERS or self.overlap.offload()))

    async def copy(self, destination: int, source: int, nbytes: int, keep: object,
                   ended: Callable[[bool], None]) -> None:
        """Copy `nbytes` from `source` to `destination` on a worker; `keep` holds both alive
        until the copy ends. `ended(completed)` runs on the loop exactly once, when the copy
        has ended (False: it failed or never ran, or its caller was cancelled: the copy is
        not the caller's any more), before this returns or raises."""
        queue = self._queue
        assert queue is not None, "offloads() said the copy stays inline"
        started, started_cpu = time.perf_counter(), time.thread_time()
        mark, beside = self._submitted, queue.in_flight + queue.waiting > 0
        self._submitted += 1

        def finish(result: object, error: BaseException | None, abandoned: bool) -> None:
            if beside or self._submitted - mark > 1:
                self.overlap.measured(1.0, 1.0)
            else:  # on the loop's thread: its CPU time since the submit is what it did meanwhile
                self.overlap.measured(time.thread_time() - started_cpu,
                                      time.perf_counter() - started)
            ended(error is None and not abandoned)

        await queue.copy(destination, source, nbytes, finish, keep)

    @property
    def path(self) -> str:
        if self._queue is None:
            return "inline"
        where = f"native workers from {NATIVE_COPY_MIN >> 10} KiB"
        if self._mode is Mode.WORKERS:
            return where
        now = "on" if self.overlap.busy >= BUSY_ENOUGH else "off: the loop waits idle for them"
        return f"{where} while the loop is busy meanwhile (now {now})"
