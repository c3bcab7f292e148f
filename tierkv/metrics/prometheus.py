"""Prometheus exposition of `Engine.metrics()`: a custom collector that reads the snapshot at
scrape time, so nothing is counted twice and an unscraped engine pays nothing.

``collector = tierkv.metrics.register(kv)`` adds an engine to a registry (the default
`prometheus_client.REGISTRY`, or the application's own), ``tierkv.metrics.unregister(collector)``
takes it out; ``tierkv serve-metrics`` serves one engine on its own. One engine per registry:
the metric names carry no engine label, so a second `register` into the same registry raises
`ValueError` (prometheus_client's `DuplicateTimeseries`).

Threads. The engine's state belongs to its event loop, and a snapshot moves breakers and the
miss-storm window forward, so it is always taken on the loop: a scrape on the loop's own thread
(an asyncio web framework calling `generate_latest`) reads it directly; a scrape on another
thread (`prometheus_client.start_http_server` serves each scrape on a thread of its own) hands
the read to the loop (`asyncio.run_coroutine_threadsafe`) and waits at most `timeout` seconds
for it (a loop blocked longer fails the scrape, with `TimeoutError`, rather than read state
mid-change); while the loop is not running nothing changes it, and it is read directly.

Names (`tier`: the tier's configured name):

- per tier, counters: ``tierkv_tier_hits_total``, ``_misses_total`` (gets neither it nor a
  faster tier served), ``_bytes_written_total``, ``_bytes_read_total``, ``_evictions_total``,
  ``_promotions_total``, ``_demotions_total``, ``_promoted_bytes_total``,
  ``_demoted_bytes_total``, ``_admitted_total`` and ``_admission_rejects_total`` (tiers with an
  admission filter only); gauges: ``tierkv_tier_used_bytes``, ``_capacity_bytes``,
  ``_recovered_objects``; ``tierkv_tier_info{tier,kind,persistent}``;
- breakers: ``tierkv_breaker_state{tier,state}`` (1 for the state it is in, 0 for the others),
  ``tierkv_breaker_transitions_total{tier,state}`` (changes into `state`),
  ``tierkv_breaker_calls_total``, ``_failures_total``, ``_slow_calls_total``,
  ``_rejected_total`` (calls refused while open);
- histograms: ``tierkv_get_latency_seconds{tier,result}`` (``result="hit"`` by the tier that
  served it, ``result="miss"`` with an empty tier), ``tierkv_put_latency_seconds{tier}`` (the
  tier the object went into first), ``tierkv_get_many_latency_seconds`` (one per call);
- engine counters: ``tierkv_gets_total``, ``tierkv_misses_total``, ``tierkv_puts_total``,
  ``tierkv_migrations_failed_total``, ``tierkv_migrations_discarded_total``,
  ``tierkv_migrated_bytes_total``, ``tierkv_prefetches_total``,
  ``tierkv_dropped_objects_total``, ``tierkv_expired_objects_total``,
  ``tierkv_invalidated_objects_total``, ``tierkv_cascaded_objects_total``,
  ``tierkv_corrupt_reads_total``, ``tierkv_device_errors_total``,
  ``tierkv_breaker_skips_total``, ``tierkv_space_waits_total``,
  ``tierkv_space_timeouts_total``, ``tierkv_cancelled_calls_total``,
  ``tierkv_recovered_superseded_total``,
  ``tierkv_dag_edges_refused_total``, ``tierkv_miss_storm_alerts_total``;
- engine gauges: ``tierkv_objects``, ``tierkv_unflushed_objects``, ``tierkv_pinned_objects``,
  ``tierkv_dag_nodes``, ``tierkv_dag_edges``, ``tierkv_migrations_in_flight``,
  ``tierkv_recovery_seconds``, ``tierkv_miss_storm_alerting`` (0/1),
  ``tierkv_miss_storm_entropy_bits`` (no sample while the window is empty),
  ``tierkv_miss_storm_threshold_bits``, ``tierkv_miss_storm_watching`` (0/1),
  ``tierkv_miss_storm_window_misses``,
  ``tierkv_miss_storm_prefixes``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from tierkv.health import BreakerState
from tierkv.metrics.snapshot import EngineMetrics, Histogram, TierMetrics

if TYPE_CHECKING:
    from tierkv.engine import Engine

#: seconds a scrape from another thread waits for the loop to take the snapshot
SCRAPE_TIMEOUT = 5.0

_TierFigure = Callable[[TierMetrics], float]
_EngineFigure = Callable[[EngineMetrics], float]

_TIER_COUNTERS: tuple[tuple[str, str, _TierFigure], ...] = (
    ("tierkv_tier_hits_total", "Gets the tier served.", lambda t: t.hits),
    ("tierkv_tier_misses_total", "Gets neither the tier nor a faster one served.",
     lambda t: t.misses),
    ("tierkv_tier_bytes_written_total", "Payload bytes stored into the tier.",
     lambda t: t.bytes_written),
    ("tierkv_tier_bytes_read_total",
     "Payload bytes gets and migrations read out of the tier.", lambda t: t.bytes_read),
    ("tierkv_tier_evictions_total", "Copies that left the tier for room or idleness.",
     lambda t: t.evictions),
    ("tierkv_tier_promotions_total", "Copies moved up into the tier.", lambda t: t.promotions),
    ("tierkv_tier_demotions_total", "Copies moved down into the tier.", lambda t: t.demotions),
    ("tierkv_tier_promoted_bytes_total", "Payload bytes moved up into the tier.",
     lambda t: t.promoted_bytes),
    ("tierkv_tier_demoted_bytes_total", "Payload bytes moved down into the tier.",
     lambda t: t.demoted_bytes),
)
_TIER_GAUGES: tuple[tuple[str, str, _TierFigure], ...] = (
    ("tierkv_tier_used_bytes", "Bytes of the tier's capacity in use.", lambda t: t.used_bytes),
    ("tierkv_tier_capacity_bytes", "The tier's capacity in bytes.", lambda t: t.capacity_bytes),
    ("tierkv_tier_recovered_objects", "Intact objects the tier recovered when the engine opened.",
     lambda t: t.recovered),
)
_BREAKER_COUNTERS: tuple[tuple[str, str, _TierFigure], ...] = (
    ("tierkv_breaker_calls_total", "Calls into the tier whose outcome the breaker counted.",
     lambda t: t.breaker.calls),
    ("tierkv_breaker_failures_total", "Failed calls into the tier, slow ones included.",
     lambda t: t.breaker.failures),
    ("tierkv_breaker_slow_calls_total", "Calls into the tier slower than slow_operation.",
     lambda t: t.breaker.slow),
    ("tierkv_breaker_rejected_total", "Calls the open breaker refused.",
     lambda t: t.breaker.rejected),
)
_TRANSITIONS: tuple[tuple[BreakerState, _TierFigure], ...] = (
    (BreakerState.OPEN, lambda t: t.breaker.opened),
    (BreakerState.HALF_OPEN, lambda t: t.breaker.half_opened),
    (BreakerState.CLOSED, lambda t: t.breaker.closed),
)
_ENGINE_COUNTERS: tuple[tuple[str, str, _EngineFigure], ...] = (
    ("tierkv_gets_total", "Gets (each key of a get_many counts).", lambda m: m.gets),
    ("tierkv_misses_total", "Gets no tier served.", lambda m: m.misses),
    ("tierkv_puts_total", "Puts.", lambda m: m.puts),
    ("tierkv_migrations_failed_total", "Background moves that failed.",
     lambda m: m.migrations_failed),
    ("tierkv_migrations_discarded_total", "Background moves discarded (object changed or busy).",
     lambda m: m.migrations_discarded),
    ("tierkv_migrated_bytes_total", "Payload bytes background moves copied.",
     lambda m: m.migrated_bytes),
    ("tierkv_prefetches_total", "Moves into the first tier started by prefetch.",
     lambda m: m.prefetches),
    ("tierkv_dropped_objects_total", "Objects that left the cache.", lambda m: m.dropped),
    ("tierkv_expired_objects_total", "Copies that idled out of a tier.", lambda m: m.expired),
    ("tierkv_invalidated_objects_total", "Objects removed by invalidate and invalidate_model.",
     lambda m: m.invalidated),
    ("tierkv_cascaded_objects_total", "Objects removed because an ancestor changed.",
     lambda m: m.cascaded),
    ("tierkv_corrupt_reads_total", "Copies that failed their checksum.",
     lambda m: m.corrupt_reads),
    ("tierkv_device_errors_total", "Failed calls into the tiers.", lambda m: m.device_errors),
    ("tierkv_breaker_skips_total", "Calls not made into a tier whose breaker was open.",
     lambda m: m.breaker_skips),
    ("tierkv_space_waits_total", "Writes that waited for room in a full tier.",
     lambda m: m.space_waits),
    ("tierkv_space_timeouts_total", "Writes that gave up waiting for room.",
     lambda m: m.space_timeouts),
    ("tierkv_cancelled_calls_total", "Public calls that ended cancelled.",
     lambda m: m.cancelled_calls),
    ("tierkv_recovered_superseded_total", "Older copies of a key deleted when opening.",
     lambda m: m.recovered_superseded),
    ("tierkv_dag_edges_refused_total", "Recovered edges refused (they closed a cycle).",
     lambda m: m.dag_edges_refused),
    ("tierkv_miss_storm_alerts_total", "Miss-storm alerts raised.",
     lambda m: m.miss_storm.detector.alerts),
)
_ENGINE_GAUGES: tuple[tuple[str, str, _EngineFigure], ...] = (
    ("tierkv_objects", "Objects stored.", lambda m: m.objects),
    ("tierkv_unflushed_objects", "Objects no persistent tier holds yet.", lambda m: m.unflushed),
    ("tierkv_pinned_objects", "Objects pinned by a handle.", lambda m: m.pinned),
    ("tierkv_dag_nodes", "Keys the dependency DAG knows.", lambda m: m.dag_nodes),
    ("tierkv_dag_edges", "Edges of the dependency DAG.", lambda m: m.dag_edges),
    ("tierkv_migrations_in_flight", "Background moves queued or running.",
     lambda m: m.migrations_in_flight),
    ("tierkv_recovery_seconds", "Seconds opening the tiers and indexing their objects took.",
     lambda m: m.recovery_seconds),
    ("tierkv_miss_storm_alerting", "1 while a reported miss storm has not been seen to end.",
     lambda m: float(m.miss_storm.detector.alerting)),
    ("tierkv_miss_storm_threshold_bits", "Prefix entropy below which misses are a storm.",
     lambda m: m.miss_storm.threshold_bits),
    ("tierkv_miss_storm_watching", "1 once misses have shown two key prefixes (storms told).",
     lambda m: float(m.miss_storm.watching)),
    ("tierkv_miss_storm_window_misses", "Misses in the miss-storm window.",
     lambda m: m.miss_storm.detector.window_misses),
    ("tierkv_miss_storm_prefixes", "Distinct key prefixes in the miss-storm window.",
     lambda m: m.miss_storm.detector.prefixes),
)


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    bounds = [repr(bound) for bound in histogram.bounds] + ["+Inf"]
    return list(zip(bounds, histogram.cumulative(), strict=True))


def families(m: EngineMetrics | None) -> list[Metric]:
    """The metric families of snapshot `m` (None: the families without samples, for
    `describe`)."""
    out: list[Metric] = []
    tiers = () if m is None else m.tiers
    for name, text, figure in _TIER_COUNTERS:
        counter = CounterMetricFamily(name, text, labels=["tier"])
        for tier in tiers:
            counter.add_metric([tier.name], figure(tier))
        out.append(counter)
    admitted = CounterMetricFamily("tierkv_tier_admitted_total",
                                   "Demotions the admission filter let into the tier.",
                                   labels=["tier"])
    rejected = CounterMetricFamily("tierkv_tier_admission_rejects_total",
                                   "Demotions the admission filter turned away.", labels=["tier"])
    for tier in tiers:
        if tier.admission is not None:
            admitted.add_metric([tier.name], tier.admission.admitted)
            rejected.add_metric([tier.name], tier.admission.rejected)
    out += [admitted, rejected]
    for name, text, figure in _TIER_GAUGES:
        gauge = GaugeMetricFamily(name, text, labels=["tier"])
        for tier in tiers:
            gauge.add_metric([tier.name], figure(tier))
        out.append(gauge)
    info = InfoMetricFamily("tierkv_tier", "The configured tiers.", labels=["tier"])
    for tier in tiers:
        info.add_metric([tier.name], {"kind": tier.kind.value,
                                      "persistent": str(tier.persistent).lower()})
    out.append(info)
    out += _breakers(tiers)
    out += _histograms(m)
    for name, text, engine_figure in _ENGINE_COUNTERS:
        out.append(CounterMetricFamily(name, text, value=None if m is None else engine_figure(m)))
    for name, text, engine_figure in _ENGINE_GAUGES:
        out.append(GaugeMetricFamily(name, text, value=None if m is None else engine_figure(m)))
    bits = None if m is None else m.miss_storm.detector.bits
    out.append(GaugeMetricFamily("tierkv_miss_storm_entropy_bits",
                                 "Entropy of the missed keys' prefixes in the window, bits.",
                                 value=bits))
    return out


def _breakers(tiers: Iterable[TierMetrics]) -> list[Metric]:
    state = GaugeMetricFamily("tierkv_breaker_state",
                              "1 for the state the tier's circuit breaker is in, else 0.",
                              labels=["tier", "state"])
    transitions = CounterMetricFamily("tierkv_breaker_transitions_total",
                                      "Changes of the tier's circuit breaker into the state.",
                                      labels=["tier", "state"])
    counters = [CounterMetricFamily(name, text, labels=["tier"])
                for name, text, _ in _BREAKER_COUNTERS]
    for tier in tiers:
        for each in BreakerState:
            state.add_metric([tier.name, each.value], float(tier.breaker.state is each))
        for each, figure in _TRANSITIONS:
            transitions.add_metric([tier.name, each.value], figure(tier))
        for counter, (_, _, figure) in zip(counters, _BREAKER_COUNTERS, strict=True):
            counter.add_metric([tier.name], figure(tier))
    return [state, transitions, *counters]


def _histograms(m: EngineMetrics | None) -> list[Metric]:
    gets = HistogramMetricFamily("tierkv_get_latency_seconds",
                                 "Get latency: hits by the tier that served them, and misses.",
                                 labels=["tier", "result"])
    puts = HistogramMetricFamily("tierkv_put_latency_seconds",
                                 "Put latency, by the tier the object went into first.",
                                 labels=["tier"])
    many = HistogramMetricFamily("tierkv_get_many_latency_seconds",
                                 "get_many latency, one duration per call.", labels=[])
    if m is not None:
        for tier in m.tiers:
            gets.add_metric([tier.name, "hit"], _buckets(tier.get_latency),
                            tier.get_latency.sum)
            puts.add_metric([tier.name], _buckets(tier.put_latency), tier.put_latency.sum)
        gets.add_metric(["", "miss"], _buckets(m.miss_latency), m.miss_latency.sum)
        many.add_metric([], _buckets(m.get_many_latency), m.get_many_latency.sum)
    return [gets, puts, many]


#: how often a scrape waiting for the engine's loop checks that the loop still runs
_SLICE = 0.05


class EngineCollector:
    """A `prometheus_client` collector of one engine (see the module for threads and names)."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, *,
                 timeout: float = SCRAPE_TIMEOUT) -> None:
        self.engine = engine
        self._loop = loop
        self._timeout = timeout
        #: where `register` put it (None: not registered)
        self.registry: CollectorRegistry | None = None

    def snapshot(self) -> EngineMetrics:
        """`Engine.metrics()`, taken on the engine's loop whichever thread asks."""
        loop = self._loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or not loop.is_running():
            return self.engine.metrics()
        # a callback, not a coroutine: one the loop never ran (it stopped first) is dropped
        # without a "never awaited" warning
        future: concurrent.futures.Future[EngineMetrics] = concurrent.futures.Future()
        try:
            loop.call_soon_threadsafe(self._take, future)
        except RuntimeError:  # the loop closed since it was seen running
            return self.engine.metrics()
        deadline = time.monotonic() + self._timeout
        # in slices: the loop may stop before it runs the snapshot (the engine's `asyncio.run`
        # ending), which then never came, and the scrape waited its whole timeout to fail
        while True:
            try:
                return future.result(max(0.0, min(_SLICE, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                stopped = not loop.is_running()
                if stopped or time.monotonic() >= deadline:
                    future.cancel()
                    if stopped:
                        return self.engine.metrics()
                    raise

    def _take(self, future: concurrent.futures.Future[EngineMetrics]) -> None:
        """On the loop: the snapshot into `future`, unless its scrape gave up."""
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(self.engine.metrics())
            except Exception as exc:  # a defect: the scrape raises it
                future.set_exception(exc)

    def describe(self) -> list[Metric]:
        return families(None)

    def collect(self) -> list[Metric]:
        return families(self.snapshot())


def register(engine: Engine, registry: CollectorRegistry = REGISTRY, *,
             timeout: float = SCRAPE_TIMEOUT) -> EngineCollector:
    """Expose `engine` in `registry` (prometheus_client's default one unless given); returns
    the collector, for `unregister`. Call it on the engine's event loop (inside async code):
    the collector remembers that loop to take its snapshots on. `ValueError` if the registry
    already holds these names (another engine)."""
    collector = EngineCollector(engine, asyncio.get_running_loop(), timeout=timeout)
    registry.register(collector)
    collector.registry = registry
    return collector


def unregister(collector: EngineCollector) -> None:
    """Take `collector` out of the registry `register` put it in (no-op if it was not)."""
    registry = collector.registry
    if registry is not None:
        registry.unregister(collector)
        collector.registry = None
