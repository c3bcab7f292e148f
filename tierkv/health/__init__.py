"""Health: pure detectors with the clock passed in (circuit breakers per tier, miss storms). No IO
but log lines; the engine feeds them outcomes and acts on their answers."""

from tierkv.health.breaker import BreakerSnapshot, BreakerState, CircuitBreaker, Listener, Permit
from tierkv.health.miss_storm import MissStormAlert, MissStormDetector, MissStormSnapshot

__all__ = [
    "BreakerSnapshot",
    "BreakerState",
    "CircuitBreaker",
    "Listener",
    "MissStormAlert",
    "MissStormDetector",
    "MissStormSnapshot",
    "Permit",
]
