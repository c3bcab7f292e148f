"""Group commit: concurrent callers that need one tier flushed share one flush.

Each caller takes a ticket; a flush covers every ticket taken before it started, because the
writes of those callers were issued before it. A caller whose ticket the running flush does not
cover waits for that flush to end and then joins (or starts) the next one, which covers it. A
flush starts one turn of the loop after it is asked for, so that the callers the previous flush
just released, who write again at once, join it instead of waiting for one more: eight
write-through puts in a loop cost about one flush per round of eight, not eight. A flush runs as
a task of its own: a caller cancelled while waiting does not cancel it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class _Flush:
    task: asyncio.Task[None] | None = None
    covered: int = 0  # the last ticket taken before it started


class GroupCommit:
    def __init__(self, flush: Callable[[], Awaitable[None]], *, enabled: bool = True) -> None:
        self._flush = flush
        self.enabled = enabled
        self._tickets = 0
        self._running: _Flush | None = None
        #: flushes run and the callers they served, for stats
        self.flushes = 0
        self.requests = 0

    async def sync(self) -> None:
        """Return once a flush that started after this call began has completed; raise its
        error if it failed. With group commit off, each call runs its own flush."""
        self.requests += 1
        if not self.enabled:
            self.flushes += 1
            await self._flush()
            return
        self._tickets += 1
        ticket = self._tickets
        while True:
            flush = self._running or self._start()
            assert flush.task is not None
            await asyncio.wait({flush.task})
            if flush.covered >= ticket:
                flush.task.result()  # its error is this caller's too
                return

    def _start(self) -> _Flush:
        flush = self._running = _Flush()
        # the task's first step runs after the callbacks already scheduled: the callers woken
        # by the last flush write and take their tickets before it counts them
        flush.task = asyncio.get_running_loop().create_task(self._flush_once(flush))
        flush.task.add_done_callback(lambda task: self._ended(flush))
        return flush

    async def _flush_once(self, flush: _Flush) -> None:
        flush.covered = self._tickets
        self.flushes += 1
        await self._flush()

    def _ended(self, flush: _Flush) -> None:
        if self._running is flush:
            self._running = None
        if flush.task is not None and not flush.task.cancelled():
            flush.task.exception()  # retrieved: a failure nobody waited for is not reported twice
