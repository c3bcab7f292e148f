"""The report of a trace replay: one JSON record and rows per capacity point, and a summary.

Every engine figure stands beside its baseline: the prefix-served hit ratio beside the offline LRU
and Belady MIN of as many blocks (`trace_baselines`), the blocks the hierarchy held beside the
blocks LRU holds, what each tier served beside the engine's hit counter of that tier, the bytes
written into each tier beside the bytes the puts carried. Hit ratios are printed in percent (the
rows' renderer shows baselines to one decimal); the JSON keeps fractions.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierkv.bench.common import Row, percentile
from tierkv.bench.trace_config import TierSizing

if TYPE_CHECKING:  # the replay imports this module
    from tierkv.bench.trace import PointCounts

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Baselines:
    """The offline hit ratios of one capacity point, and the seconds each took."""

    blocks: int
    lru: float
    min: float
    lru_seconds: float
    min_seconds: float
    #: the blocks the resized tiers had room for, and LRU's hit ratio with as many
    holdable: int
    lru_at_holdable: float
    #: the blocks the engine held on average over the replay's second half, and LRU's hit ratio
    #: with as many
    held: int
    lru_at_held: float


def gap_closed(engine: float, lru: float, best: float) -> float | None:
    """The fraction of the LRU→MIN gap the engine closed; ``None`` when there is no gap."""
    if best - lru <= 1e-12:
        return None
    return (engine - lru) / (best - lru)


def point_result(counts: PointCounts, stats: Mapping[str, Any], *, fraction: float,
                 total_bytes: int, block_size: int, baselines: Baselines,
                 sizings: Sequence[TierSizing], opened: Mapping[str, tuple[int, int]],
                 ) -> dict[str, Any]:
    """The JSON record of one capacity point.

    `opened` is each tier's (capacity, footprint of one block) as the opened tier reports them;
    `holdable_blocks` is what the tiers could hold together if no block had a copy in two.
    """
    engine = stats["engine"]
    hit = counts.served / counts.references if counts.references else 0.0
    tiers: dict[str, dict[str, Any]] = {}
    for sizing in sizings:
        capacity, footprint = opened[sizing.name]
        tiers[sizing.name] = {
            "kind": sizing.kind.value,
            "share": sizing.share,
            "share_bytes": sizing.share_bytes,
            "configured_bytes": sizing.capacity,
            "raised_to_minimum": sizing.raised_to_minimum,
            "capacity_bytes": capacity,
            "block_footprint_bytes": footprint,
            "share_blocks": sizing.share_bytes // block_size,
            "holdable_blocks": capacity // footprint,
            "max_used_bytes": counts.max_used[sizing.name],
        }
    lookups = sorted(counts.lookup_us)
    return {
        "capacity_fraction": fraction,
        "capacity_bytes": total_bytes,
        "capacity_blocks": baselines.blocks,
        "configured_bytes": sum(tier["configured_bytes"] for tier in tiers.values()),
        "holdable_blocks": baselines.holdable,
        "max_objects_held": counts.max_objects,
        "mean_objects_held": counts.mean_objects,
        "requests": counts.requests,
        "block_references": counts.references,
        "blocks_served": counts.served,
        "blocks_put": counts.puts,
        "put_bytes": counts.puts * block_size,
        "hit_ratio": hit,
        "lru_hit_ratio": baselines.lru,
        "min_hit_ratio": baselines.min,
        "lru_hit_ratio_at_holdable": baselines.lru_at_holdable,
        "lru_hit_ratio_at_mean_held": baselines.lru_at_held,
        "gap_closed": gap_closed(hit, baselines.lru, baselines.min),
        "baseline_seconds": {"lru": baselines.lru_seconds, "min": baselines.min_seconds},
        "served_by_tier": dict(counts.served_by_tier),
        "hits_by_tier_all_found": dict(engine["hits"]),
        "demotions": dict(engine["demotions"]),
        "promotions": dict(engine["promotions"]),
        "demoted_bytes": dict(engine["demoted_bytes"]),
        "promoted_bytes": dict(engine["promoted_bytes"]),
        "written_bytes": dict(engine["written_bytes"]),
        "tiers": tiers,
        "wall_s": counts.seconds,
        "requests_per_s": counts.requests / counts.seconds if counts.seconds else 0.0,
        "lookup_p50_us": percentile(lookups, 0.5),
        "lookup_p99_us": percentile(lookups, 0.99),
        "stats": stats,
    }


def point_rows(label: str, point: Mapping[str, Any]) -> list[Row]:
    """The printed rows of one capacity point (`label`: its capacity, e.g. ``10%``)."""
    name = f"trace {label}"
    lru_blocks = point["capacity_blocks"]
    rows = [
        Row(f"{name}: hit % (prefix-served) vs offline LRU", "%", 100 * point["hit_ratio"],
            100 * point["lru_hit_ratio"], "LRU"),
        Row(f"{name}: hit % vs Belady MIN (no prefix rule, a bound)", "%",
            100 * point["hit_ratio"], 100 * point["min_hit_ratio"], "MIN"),
    ]
    if point["gap_closed"] is not None:
        rows.append(Row(f"{name}: LRU→MIN gap closed", "%", 100 * point["gap_closed"]))
    rows += [
        Row(f"{name}: hit % vs offline LRU of the blocks the engine held", "%",
            100 * point["hit_ratio"], 100 * point["lru_hit_ratio_at_mean_held"], "LRU"),
        Row(f"{name}: blocks held (mean, 2nd half of the trace) vs LRU's", "blocks",
            point["mean_objects_held"], lru_blocks, "LRU blocks"),
        Row(f"{name}: most blocks held at once vs LRU's", "blocks", point["max_objects_held"],
            lru_blocks, "LRU blocks"),
        Row(f"{name}: blocks the tiers can hold vs LRU's", "blocks", point["holdable_blocks"],
            lru_blocks, "LRU blocks"),
    ]
    if point["holdable_blocks"] != lru_blocks:
        rows.append(Row(f"{name}: hit % vs offline LRU of the blocks the tiers can hold", "%",
                        100 * point["hit_ratio"], 100 * point["lru_hit_ratio_at_holdable"],
                        "LRU"))
    for tier, sizing in point["tiers"].items():
        raised = ", raised to its minimum" if sizing["raised_to_minimum"] else ""
        rows.append(Row(f"{name}: blocks {tier} can hold vs its share{raised}", "blocks",
                        sizing["holdable_blocks"], sizing["share_blocks"], "share"))
    hits = point["hits_by_tier_all_found"]
    for tier in point["tiers"]:
        rows.append(Row(f"{name}: blocks served from {tier}", "blocks",
                        point["served_by_tier"].get(tier, 0), hits.get(tier, 0),
                        "engine hits, all found"))
    put_mib = point["put_bytes"] / MiB
    for counter, verb in (("written_bytes", "written into"), ("demoted_bytes", "demoted into"),
                          ("promoted_bytes", "promoted into")):
        for tier, nbytes in point[counter].items():
            if nbytes:
                rows.append(Row(f"{name}: {verb} {tier}", "MiB", nbytes / MiB, put_mib,
                                "put bytes"))
    rows += [
        Row(f"{name}: requests replayed", "req/s", point["requests_per_s"]),
        Row(f"{name}: replay wall time", "s", point["wall_s"]),
    ]
    return rows


def summary(points: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], list[Row]]:
    """Averages over the capacity points: hit ratio beside LRU's and MIN's, gap closed."""
    if not points:
        return {"average_gap_closed": None}, []
    gaps = [point["gap_closed"] for point in points if point["gap_closed"] is not None]
    average_gap = statistics.fmean(gaps) if gaps else None
    hit = statistics.fmean(point["hit_ratio"] for point in points)
    lru = statistics.fmean(point["lru_hit_ratio"] for point in points)
    best = statistics.fmean(point["min_hit_ratio"] for point in points)
    document: dict[str, Any] = {
        "average_hit_ratio": hit,
        "average_lru_hit_ratio": lru,
        "average_min_hit_ratio": best,
        "average_gap_closed": average_gap,
        "wall_s": math.fsum(point["wall_s"] for point in points),
    }
    count = len(points)
    rows = [Row(f"trace, {count} capacities: mean hit % vs offline LRU", "%", 100 * hit,
                100 * lru, "LRU")]
    if average_gap is not None:
        rows.append(Row(f"trace, {count} capacities: mean LRU→MIN gap closed", "%",
                        100 * average_gap))
    return document, rows
