"""Puts that arrive together go to the server together: one pipelined round trip.

The engine writes the shared tier from many tasks at once (every put is shared in the
background, up to `migration_concurrency` at a time). Each `SetBatcher.set` queues its command
and returns a future; the commands queued in one turn of the loop are sent in one pipeline (at
most `limit` per round trip) as soon as that turn ends, so no put waits for a timer, and a put
alone costs what it did. A pipeline is not a transaction: each command succeeds or fails by
itself, and each future learns its own outcome. A caller that stops waiting does not cancel
the round trip its command is in (the Tier contract: background work outlives its caller).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tierkv.errors import DeviceError
from tierkv.tiers.redis._joined import Joined

#: what the tier hands over: a new pipeline, and its bounded call (timeout, pool slot, errors)
NewPipeline = Callable[[], Any]
Call = Callable[[Awaitable[Any]], Awaitable[Any]]


class SetBatcher:
    def __init__(self, pipeline: NewPipeline, call: Call, limit: int, what: str) -> None:
        self._pipeline = pipeline
        self._call = call
        self._limit = limit
        self._what = what
        self._queue: list[tuple[list[Any], asyncio.Future[None]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: round trips sent, for the tier's stats
        self.round_trips = 0

    def set(self, key: bytes, value: bytes | Joined, px: int | None) -> asyncio.Future[None]:
        """Queue ``SET key value [PX px]``; the future ends when the server answered it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        command: list[Any] = ["SET", key, value] if px is None else ["SET", key, value, "PX", px]
        if not self._queue:
            loop.call_soon(self._send)
        self._queue.append((command, future))
        return future

    def _send(self) -> None:
        queued, self._queue = self._queue, []
        for start in range(0, len(queued), self._limit):
            task = asyncio.get_running_loop().create_task(
                self._round_trip(queued[start:start + self._limit]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _round_trip(self, batch: list[tuple[list[Any], asyncio.Future[None]]]) -> None:
        pipe = self._pipeline()
        for command, _ in batch:
            pipe.execute_command(*command)
        self.round_trips += 1
        try:
            answers = await self._call(pipe.execute(raise_on_error=False))
        except BaseException as exc:
            failure = exc if isinstance(exc, DeviceError) else DeviceError(
                f"{self._what}: the write was abandoned ({type(exc).__name__})")
            for _, future in batch:
                if not future.done():  # an error each: a raised one carries its traceback
                    future.set_exception(DeviceError(str(failure)))
            if not isinstance(exc, DeviceError | asyncio.CancelledError):
                raise
            return
        for (_, future), answer in zip(batch, answers, strict=True):
            if future.done():
                continue
            if isinstance(answer, Exception):
                future.set_exception(DeviceError(f"{self._what}: {type(answer).__name__}: "
                                                 f"{answer}"))
            else:
                future.set_result(None)

    async def drain(self) -> None:
        """Wait for the round trips under way (close)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
