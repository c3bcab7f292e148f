"""Metrics: the typed snapshot `Engine.metrics()` returns (`snapshot`) and its Prometheus
exposition (`prometheus`): `register(kv, registry)` for an application that runs a registry,
`tierkv serve-metrics` for an engine on its own."""

from tierkv.metrics.prometheus import EngineCollector, register, unregister
from tierkv.metrics.snapshot import Admission, EngineMetrics, Histogram, MissStorm, TierMetrics

__all__ = [
    "Admission",
    "EngineCollector",
    "EngineMetrics",
    "Histogram",
    "MissStorm",
    "TierMetrics",
    "register",
    "unregister",
]
