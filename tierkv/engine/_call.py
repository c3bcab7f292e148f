"""The async context every public call of the engine runs in."""

from __future__ import annotations

from tierkv.engine._state import EngineState


class Call:
    """The async context of a public call: counted in `EngineState.active` while it runs (a
    class rather than a generator: it wraps every get, where microseconds count); `close`
    waits until no call is active."""

    __slots__ = ("_st",)

    def __init__(self, state: EngineState) -> None:
        self._st = state

    async def __aenter__(self) -> None:
        self._st.active += 1
        self._st.quiet.clear()

    async def __aexit__(self, *exc_info: object) -> None:
        st = self._st
        st.active -= 1
        if not st.active:
            st.quiet.set()
