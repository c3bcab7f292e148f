"""`tierkv.open`: usable as ``kv = await tierkv.open(cfg)`` and ``async with tierkv.open(cfg)``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator, Mapping
from types import TracebackType
from typing import Any

from tierkv.config import Config, load_config
from tierkv.engine.engine import Engine
from tierkv.tiers.registry import make_tier

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | Config
Clock = Callable[[], float]


async def open_engine(config: ConfigSource, clock: Clock = time.monotonic) -> Engine:
    loaded = load_config(config)
    engine = Engine(loaded, [make_tier(tier) for tier in loaded.tiers], clock)
    await engine._start()
    return engine


class EngineOpening:
    """The pending result of `tierkv.open`; await it, or enter it with ``async with``."""

    def __init__(self, config: ConfigSource, clock: Clock) -> None:
        self._config = config
        self._clock = clock
        self._engine: Engine | None = None

    def __await__(self) -> Generator[Any, None, Engine]:
        return open_engine(self._config, self._clock).__await__()

    async def __aenter__(self) -> Engine:
        self._engine = await open_engine(self._config, self._clock)
        return self._engine

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._engine is not None:
            await self._engine.close()


def open(config: ConfigSource, *, clock: Clock = time.monotonic) -> EngineOpening:
    """Open an engine on `config` (a TOML path, a parsed mapping or a `Config`).

    `clock` is the time the scheduler sees, in seconds (access times, score decay, TTLs); a
    trace replay passes a virtual clock driven by the trace's timestamps. Pacing of background
    moves and timeouts always run on the loop's own clock."""
    return EngineOpening(config, clock)
