"""The observing half of the engine's public API: `metrics`, `stats`, `on_miss_storm`.

A mixin of `Engine`, apart from `engine.py` only to keep each file to one idea and a readable
length (as `_read_calls` holds the reads). Nothing here waits or changes what is stored.
"""

from __future__ import annotations

from typing import Any

from tierkv.engine._executor import MoveExecutor
from tierkv.engine._metrics import engine_metrics, engine_stats
from tierkv.engine._state import EngineState
from tierkv.engine._storms import MissStormCallback
from tierkv.metrics.snapshot import EngineMetrics


class ObserveCalls:
    """`Engine`'s metrics, stats and miss-storm callback; the engine provides the attributes
    below."""

    _st: EngineState
    _executor: MoveExecutor

    def on_miss_storm(self, callback: MissStormCallback | None) -> None:
        """Call `callback(alert)` with each miss-storm alert from now on, replacing any earlier
        callback (None: none). A miss storm: the misses of the last `[health] window` seconds
        (on the engine's clock) carry less than `[health] entropy_alert_bits` bits of
        key-prefix entropy: one tenant, model or key family misses
        (`tierkv.health.MissStormDetector`). A str or bytes key's prefix is the key up to its
        first ``/`` or ``:`` (at most 16 bytes), a `BlockKey`'s its `model` (else its
        `rope_theta`): the tenant namespace is hashed into the digest. Nothing is a storm until
        the misses have shown two prefixes (one model's blocks alone always miss under one).
        One alert per storm, repeated once a window while it lasts; each is also logged
        (WARNING) and counted in `metrics()`.

        The callback runs on the event loop, inside the get that noticed the storm: keep it
        short (schedule anything longer). What it raises is logged, never raised to the get.
        `TypeError` for a `callback` that is neither callable nor None."""
        if callback is not None and not callable(callback):
            raise TypeError(f"the miss-storm callback is a callable or None, not "
                            f"{type(callback).__name__}")
        self._st.misses.callback = callback

    def metrics(self) -> EngineMetrics:
        """A typed snapshot of the engine's counters and gauges (`tierkv.metrics.snapshot`):
        per tier hits, misses, bytes in and out, evictions, promotions, demotions, admission
        rejects, breaker state and latency histograms; for the engine objects, the DAG,
        recovery figures, the migration backlog and the miss-storm detector. Taken in one
        step; call it on the engine's loop (`tierkv.metrics.prometheus` shows how from another
        thread). Works on a closed engine too (its final figures)."""
        return engine_metrics(self._st, in_flight=self._executor.in_flight,
                              pinned=len(self._st.pins))

    def stats(self) -> dict[str, Any]:
        """Counters and gauges as plain data: ``{"engine": {...}, "tiers": {name: {...}}}``
        (`metrics` is the typed snapshot)."""
        return engine_stats(self._st, in_flight=self._executor.in_flight,
                            pinned=len(self._st.pins))
