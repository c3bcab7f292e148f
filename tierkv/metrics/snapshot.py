"""The typed snapshot `Engine.metrics()` returns: frozen records, taken on the loop in one step.

Counters count from the engine's open (totals, never reset); gauges are the state at the
snapshot. Byte figures are payload bytes (headers and alignment left out). Nothing here reads
the engine: `Engine.metrics` fills the records, the Prometheus collector
(`tierkv.metrics.prometheus`) renders them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierkv.config import TierKind
from tierkv.health import BreakerSnapshot, MissStormSnapshot


@dataclass(frozen=True, slots=True)
class Histogram:
    """Durations in fixed buckets (seconds). `counts[i]` counts durations in
    ``(bounds[i-1], bounds[i]]`` (the first from 0); the last count, one past `bounds`, those
    above the last bound. Not cumulative: `cumulative` is the Prometheus form."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    #: the durations added up
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready) for `Engine.stats()`."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}

    def cumulative(self) -> tuple[int, ...]:
        """Durations at or below each bound, then all of them (the ``+Inf`` bucket)."""
        running, out = 0, []
        for count in self.counts:
            running += count
            out.append(running)
        return tuple(out)

    def quantile(self, q: float) -> float | None:
        """The bound of the bucket that holds the `q`-quantile (an upper estimate; ``inf`` in
        the open bucket), None when empty. `ValueError` for `q` outside [0, 1]."""
        if not 0 <= q <= 1:
            raise ValueError(f"q must lie in [0, 1], got {q!r}")
        total = self.count
        if not total:
            return None
        rank = max(q * total, 1)
        for index, running in enumerate(self.cumulative()):
            if running >= rank:
                return self.bounds[index] if index < len(self.bounds) else float("inf")
        return float("inf")  # pragma: no cover - the last cumulative count is the total


@dataclass(frozen=True, slots=True)
class Admission:
    """The admission filter in front of a persistent tier (``lru++``): demotions it let in and
    turned away (those stay in the tier above, or leave the cache)."""

    admitted: int
    rejected: int


@dataclass(frozen=True, slots=True)
class TierMetrics:
    name: str
    kind: TierKind
    persistent: bool
    capacity_bytes: int
    used_bytes: int
    #: gets this tier served
    hits: int
    #: gets neither this tier nor a faster one served (a miss of the cache counts in every tier)
    misses: int
    #: bytes stored into the tier by puts, flushes and moves; bytes gets were served from it
    #: and promotions, demotions and shares copied out of it
    bytes_written: int
    bytes_read: int
    #: copies that left the tier to make room or because they idled
    evictions: int
    #: copies moved up into the tier (promotions) and down into it (demotions), and their bytes
    promotions: int
    demotions: int
    promoted_bytes: int
    demoted_bytes: int
    #: None where no filter guards the tier (not persistent, or not ``lru++``)
    admission: Admission | None
    #: intact objects the tier handed back when the engine opened (0 if not persistent)
    recovered: int
    breaker: BreakerSnapshot
    #: the gets it served and the puts that landed in it first
    get_latency: Histogram
    put_latency: Histogram


@dataclass(frozen=True, slots=True)
class MissStorm:
    """The miss-storm detector (`tierkv.health.MissStormDetector`) over the engine's misses."""

    #: the alert threshold, bits (`[health] entropy_alert_bits`) and the window, seconds
    threshold_bits: float
    window: float
    #: the misses have shown two key prefixes at least; until then nothing is a storm (a key
    #: space of one part, such as one model's blocks, always misses under one prefix)
    watching: bool
    detector: MissStormSnapshot


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    tiers: tuple[TierMetrics, ...]
    #: get calls (each key of a `get_many` counts as one), misses, put calls
    gets: int
    misses: int
    puts: int
    objects: int
    #: objects no persistent tier holds yet; objects pinned by a handle
    unflushed: int
    pinned: int
    #: the dependency DAG: keys it knows (stored or not) and its edges
    dag_nodes: int
    dag_edges: int
    #: opening: the seconds it took, older copies of a key it deleted, recovered edges it
    #: refused (they would have closed a cycle)
    recovery_seconds: float
    recovered_superseded: int
    dag_edges_refused: int
    #: background moves queued or running (the migration backlog), and the totals of moves
    #: that failed, were discarded (the object changed or was busy) and bytes moved
    migrations_in_flight: int
    migrations_failed: int
    migrations_discarded: int
    migrated_bytes: int
    prefetches: int
    #: objects that left the cache, idled out, were invalidated, or went with an ancestor
    dropped: int
    expired: int
    invalidated: int
    cascaded: int
    corrupt_reads: int
    device_errors: int
    #: calls not made into a tier whose breaker was open (each tier's `breaker` counts its
    #: state changes)
    breaker_skips: int
    space_waits: int
    space_timeouts: int
    #: public calls that ended cancelled (timeouts, cancellations of the caller)
    cancelled_calls: int
    miss_latency: Histogram
    get_many_latency: Histogram
    miss_storm: MissStorm

    def tier(self, name: str) -> TierMetrics:
        """The tier called `name`; `KeyError` if there is none."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)
