"""`Engine.metrics()`: the typed snapshot (`tierkv.metrics.snapshot`) read from the engine's
counters, histograms, breakers and detector, in one step on the loop (no await: consistent);
and `Engine.stats()`, the same as plain data."""

from __future__ import annotations

from typing import Any

from tierkv.engine._state import EngineState
from tierkv.metrics.snapshot import Admission, EngineMetrics, MissStorm, TierMetrics


def engine_metrics(st: EngineState, *, in_flight: int, pinned: int) -> EngineMetrics:
    counters, latency = st.counters, st.latency
    tiers: list[TierMetrics] = []
    # a tier's misses: the gets that ended served by a slower tier or by none. Counted from
    # ended gets only (a get counts in `gets` as it starts): one still reading would count as
    # a miss of the tier about to serve it, and a scrape then saw that counter go down.
    unserved = counters.misses + sum(counters.hits.values())
    for index, (tier, name) in enumerate(zip(st.tiers, st.names, strict=True)):
        hits = counters.hits.get(name, 0)
        unserved -= hits
        admission = st.scheduler.admission.get(index)
        tiers.append(TierMetrics(
            name=name, kind=tier.kind, persistent=tier.persistent,
            capacity_bytes=tier.capacity, used_bytes=tier.used,
            hits=hits, misses=unserved,
            bytes_written=counters.written_bytes.get(name, 0),
            bytes_read=st.read_bytes[index],
            evictions=counters.evictions.get(name, 0),
            promotions=counters.promotions.get(name, 0),
            demotions=counters.demotions.get(name, 0),
            promoted_bytes=counters.promoted_bytes.get(name, 0),
            demoted_bytes=counters.demoted_bytes.get(name, 0),
            admission=None if admission is None
            else Admission(admitted=admission.admitted, rejected=admission.rejected),
            recovered=counters.recovered.get(name, 0),
            breaker=st.guards[index].snapshot(),
            get_latency=latency.hits[index].snapshot(),
            put_latency=latency.puts[index].snapshot()))
    detector = st.misses.detector
    return EngineMetrics(
        tiers=tuple(tiers), gets=counters.gets, misses=counters.misses, puts=counters.puts,
        objects=len(st.index), unflushed=st.index.unflushed, pinned=pinned,
        dag_nodes=len(st.dag), dag_edges=st.dag.edges,
        recovery_seconds=counters.recovery_s,
        recovered_superseded=counters.recovered_superseded,
        dag_edges_refused=counters.dag_edges_refused,
        migrations_in_flight=in_flight, migrations_failed=counters.moves_failed,
        migrations_discarded=counters.moves_discarded, migrated_bytes=counters.moved_bytes,
        prefetches=counters.prefetches, dropped=counters.drops, expired=counters.expired,
        invalidated=counters.invalidations, cascaded=counters.cascaded,
        corrupt_reads=counters.corrupt_reads, device_errors=counters.device_errors,
        breaker_skips=counters.breaker_skips, space_waits=counters.space_waits,
        space_timeouts=counters.space_timeouts, cancelled_calls=counters.cancelled_calls,
        miss_latency=latency.misses.snapshot(), get_many_latency=latency.get_many.snapshot(),
        miss_storm=MissStorm(threshold_bits=st.misses.threshold_bits, window=detector.window,
                             watching=st.misses.watching, detector=st.misses.snapshot()))


def engine_stats(st: EngineState, *, in_flight: int, pinned: int) -> dict[str, Any]:
    engine = st.counters.to_dict()
    engine.update(
        objects=len(st.index),
        unflushed=st.index.unflushed,
        pinned=pinned,
        moves_in_flight=in_flight,
        group_commits={st.names[i]: {"flushes": c.flushes, "requests": c.requests}
                       for i, c in enumerate(st.commits) if st.tiers[i].persistent},
        write_policy=st.config.engine.write_policy.value,
        miss_latency=st.latency.misses.snapshot().as_dict(),
        get_many_latency=st.latency.get_many.snapshot().as_dict(),
    )
    return {"engine": engine,
            "tiers": {tier.name: {**tier.stats(), **guard.stats(),
                                  "get_latency": st.latency.hits[i].snapshot().as_dict(),
                                  "put_latency": st.latency.puts[i].snapshot().as_dict()}
                      for i, (tier, guard) in enumerate(zip(st.tiers, st.guards,
                                                            strict=True))}}
