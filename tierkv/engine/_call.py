"""The async context every public call of the engine runs in."""

from __future__ import annotations

import asyncio

from tierkv.engine._state import EngineState


class Call:
    """The async context of a public call: counted in `EngineState.active` while it runs (a
    class rather than a generator: it wraps every get, where microseconds count); `close`
    waits until no call is active. Made on the engine's event loop, it refuses calls from
    any other (`check_loop`)."""

    __slots__ = ("_loop", "_st")

    def __init__(self, state: EngineState) -> None:
        self._st = state
        self._loop = asyncio.get_running_loop()

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

    async def __aexit__(self, *exc_info: object) -> None:
        st = self._st
        st.active -= 1
        if not st.active:
            st.quiet.set()
