"""`tierkv.open`: usable as ``kv = await tierkv.open(cfg)`` and ``async with tierkv.open(cfg)``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Coroutine, Generator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tierkv.config import Config, load_config
from tierkv.engine.engine import Engine
from tierkv.tiers.registry import make_tier

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | Config
Clock = Callable[[], float]


async def open_engine(config: ConfigSource, clock: Clock = time.monotonic,
                      tracer_provider: TracerProvider | None = None) -> Engine:
    loaded = load_config(config)
    engine = Engine(loaded, [make_tier(tier) for tier in loaded.tiers], clock,
                    tracer_provider=tracer_provider)
    await engine._start()
    return engine


class EngineOpening(Coroutine[Any, Any, Engine]):
    """The pending result of `tierkv.open`; await it, or enter it with ``async with``.

    A coroutine object too (`asyncio.iscoroutine`), so that what takes only coroutines takes
    it: ``asyncio.run_coroutine_threadsafe(tierkv.open(cfg), loop)`` from another thread,
    ``asyncio.create_task``. (Not ``asyncio.run``: the engine would belong to a loop that
    ended.) The opening starts when first awaited or sent to; one never awaited opens nothing,
    and one closed first, or awaited twice, raises `RuntimeError` as a coroutine does."""

    def __init__(self, config: ConfigSource, clock: Clock,
                 tracer_provider: TracerProvider | None = None) -> None:
        self._config = config
        self._clock = clock
        self._tracer_provider = tracer_provider
        self._engine: Engine | None = None
        self._running: Coroutine[Any, Any, Engine] | None = None
        self._closed = False

    def _opening(self) -> Coroutine[Any, Any, Engine]:
        if self._running is None:
            if self._closed:
                raise RuntimeError("cannot reuse already awaited coroutine")
            self._running = open_engine(self._config, self._clock, self._tracer_provider)
        return self._running

    def __await__(self) -> Generator[Any, None, Engine]:
        return self._opening().__await__()

    def send(self, value: Any) -> Any:
        return self._opening().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if val is None and tb is None:  # the one-argument form (the three are deprecated)
            return self._opening().throw(typ)
        return self._opening().throw(typ, val, tb)

    def close(self) -> None:
        self._closed = True
        if self._running is not None:
            self._running.close()

    async def __aenter__(self) -> Engine:
        if self._engine is not None:  # a second engine would find its own media in use
            raise RuntimeError("an engine opening is entered once; call tierkv.open again")
        self._engine = await open_engine(self._config, self._clock, self._tracer_provider)
        return self._engine

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._engine is not None:
            await self._engine.close()


def open(config: ConfigSource, *, clock: Clock = time.monotonic,
         tracer_provider: TracerProvider | None = None) -> EngineOpening:
    """Open an engine on `config` (a TOML path, a parsed mapping or a `Config`).

    `clock` is the time the scheduler sees, in seconds (access times, score decay, TTLs, the
    miss-storm window); a trace replay passes a virtual clock driven by the trace's
    timestamps. Pacing of background moves and timeouts always run on the loop's own clock.

    `tracer_provider`: the OpenTelemetry provider the engine's spans go to; None: the global
    one as it is now (`opentelemetry.trace.get_tracer_provider()`). Without an SDK behind it
    the engine makes no spans (`tierkv.engine._tracing`)."""
    return EngineOpening(config, clock, tracer_provider)
