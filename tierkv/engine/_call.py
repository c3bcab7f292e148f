"""The async context every public call of the engine runs in.

A put or delete served from memory (a roomy first tier, the pool's small copies, a key not
held) completes without suspending, so a task writing in a loop kept every other task of the
application's loop (its requests, timeouts, the engine's evictors) from running: 3,000 puts
held the loop for half a second. Writes therefore let the loop turn once every `WRITES_PER_TURN`
calls, before they change anything (a cancellation there leaves the key as it was); gets do
not, a hit is the fast path (docs/architecture.md).
"""

from __future__ import annotations

import asyncio

from tierkv.engine._state import EngineState

#: writes (puts, deletes) that may run between two turns of the event loop they give
WRITES_PER_TURN = 16


class Call:
    """The async context of a public call: counted in `EngineState.active` while it runs (a
    class rather than a generator: it wraps every get, where microseconds count); `close`
    waits until no call is active. Made on the engine's event loop, it refuses calls from
    any other (`check_loop`)."""

    __slots__ = ("_loop", "_st", "_unyielded", "_writes")

    def __init__(self, state: EngineState, *, writes: bool = False) -> None:
        self._st = state
        self._loop = asyncio.get_running_loop()
        #: a context of writes: gives the loop a turn every `WRITES_PER_TURN` calls (module)
        self._writes = writes
        self._unyielded = 0

    def check_loop(self) -> None:
        """`RuntimeError` unless running on the engine's loop: its state, its tiers' queues and
        its background tasks belong to that loop (and its thread); a call from another one
        would change them from a second thread, or fail halfway through a copy."""
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("a tierkv engine is used only on the event loop that opened it")

    async def __aenter__(self) -> None:
        self.check_loop()
        self._st.active += 1
        self._st.quiet.clear()
        if self._writes:
            self._unyielded += 1
            if self._unyielded >= WRITES_PER_TURN:
                self._unyielded = 0
                # counted active first: a `close` that starts during the turn waits for it
                try:
                    await asyncio.sleep(0)
                except BaseException as exc:
                    self._leave(type(exc))
                    raise

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self._leave(exc_type)

    def _leave(self, ended_by: type[BaseException] | None) -> None:
        st = self._st
        if ended_by is not None and issubclass(ended_by, asyncio.CancelledError):
            st.counters.cancelled_calls += 1
        st.active -= 1
        if not st.active:
            st.quiet.set()
