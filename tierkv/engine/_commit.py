"""Group commit: concurrent callers that need one tier flushed share one flush.

The same single flight serves what must never run twice at once: the engine's `flush` barrier
(`_flush`) and the save of the fleet cursor (`_shared`), each writing records of the engine's
own that two side by side could leave older than the later one meant.

Each caller takes a ticket; a flush covers every ticket taken before it started, because the
writes of those callers were issued before it. A caller whose ticket the running flush does not
cover waits for that flush to end and then joins (or starts) the next one, which covers it. A
flush starts one turn of the loop after it is asked for, so that the callers the previous flush
just released, who write again at once, join it instead of waiting for one more: eight
write-through puts in a loop cost about one flush per round of eight, not eight. A flush runs as
a task of its own: a caller cancelled while waiting does not cancel it.

The engine notes each change it makes to the tier that only a flush makes durable (`note`: a
delete, whose tombstone in the nvme log waits in the head buffer); `pending` says whether one
was made since the last flush that started after it, so that a write-through delete syncs the
tiers that hold unsynced deletes of its key — the expiry of an older value included — without
tracking keys.

A caller that can wait asks with a `linger`: a flush started for it waits up to that long for
more callers first (a caller without one starts it at once, and `hurry` starts it from outside).
Demotions out of a persistent tier linger while no writer waits for their source's room: they
only wait to drop their source, while back-to-back flushes of the nvme log, which
holds its lock across the sync, let through only the few appends that queued during each one —
a replay's demotions kept the log flushing nine tenths of the time and its pool full.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Flush:
    task: asyncio.Task[None] | None = None
    covered: int = 0  # the last ticket taken before it started
    #: set when a caller that cannot linger joins a flush that has not started yet
    hurry: asyncio.Event = field(default_factory=asyncio.Event)


class GroupCommit:
    def __init__(self, flush: Callable[[], Awaitable[None]], *, enabled: bool = True) -> None:
        self._flush = flush
        self.enabled = enabled
        self._tickets = 0
        self._running: _Flush | None = None
        #: flushes run and the callers they served, for stats
        self.flushes = 0
        self.requests = 0
        #: changes noted (`note`), and how many of them the last flush to end covered
        self._changes = 0
        self._covered_changes = 0

    def note(self) -> None:
        """A change only a flush makes durable was made (a delete)."""
        self._changes += 1

    @property
    def pending(self) -> bool:
        """Whether a change was noted that no completed flush covers."""
        return self._changes > self._covered_changes

    async def sync(self, *, linger: float = 0.0) -> None:
        """Return once a flush that started after this call began has completed; raise its
        error if it failed. With group commit off, each call runs its own flush. `linger`:
        seconds a flush started for this call may wait for other callers first."""
        self.requests += 1
        if not self.enabled:
            self.flushes += 1
            await self._covering_changes()
            return
        self._tickets += 1
        ticket = self._tickets
        while True:
            flush = self._running or self._start(linger)
            if not linger:
                flush.hurry.set()
            assert flush.task is not None
            await asyncio.wait({flush.task})
            if flush.covered >= ticket:
                flush.task.result()  # its error is this caller's too
                return

    def hurry(self) -> None:
        """Start a lingering flush now: a writer waits for the room its callers free."""
        if self._running is not None:
            self._running.hurry.set()

    def _start(self, linger: float) -> _Flush:
        flush = _Flush()
        # the task's first step runs after the callbacks already scheduled: the callers woken
        # by the last flush write and take their tickets before it counts them
        flush.task = asyncio.get_running_loop().create_task(self._flush_once(flush, linger))
        flush.task.add_done_callback(lambda task: self._ended(flush))
        self._running = flush
        return flush

    async def _flush_once(self, flush: _Flush, linger: float) -> None:
        if linger and not flush.hurry.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(flush.hurry.wait(), linger)
        flush.covered = self._tickets
        self.flushes += 1
        await self._covering_changes()

    async def _covering_changes(self) -> None:
        """One flush, which covers the changes noted before it began."""
        changes = self._changes
        await self._flush()
        self._covered_changes = max(self._covered_changes, changes)

    def _ended(self, flush: _Flush) -> None:
        if self._running is flush:
            self._running = None
        if flush.task is not None and not flush.task.cancelled():
            flush.task.exception()  # retrieved: a failure nobody waited for is not reported twice
