"""Scheduler bookkeeping per access at a million tracked objects, beside plain LRU.

The pure scheduler (no tiers, no IO) tracks `objects` keys spread over three tiers, chained in
prefix chains of 16 blocks. Timed, for ``lru++`` beside ``lru`` on the same keys: random
accesses (a hit in the tier holding the key: what every get reports), and evictions from the
first tier in batches of 16, each victim admitted below and then removed from the first tier
(what the evictor and a demotion report).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from tierkv.bench.common import Progress, Row, no_progress
from tierkv.config import EvictionPolicy, SchedulerConfig
from tierkv.scheduler import Scheduler

CHAIN = 16


@dataclass
class _Shape:
    persistent: bool
    reclaims_space: bool = False

    def can_ever_hold(self, nbytes: int) -> bool:
        return True

    def footprint(self, nbytes: int) -> int:
        return nbytes

    def fits(self, nbytes: int) -> bool:
        return False


@dataclass
class _Copies:
    key: bytes
    generation: int = 1
    nbytes: int = 16384
    locations: list[int] = field(default_factory=list)


def _run(policy: EvictionPolicy, objects: int, accesses: int, progress: Progress
         ) -> tuple[float, float]:
    """(seconds per access, seconds per eviction) of `policy` at `objects` tracked keys."""
    tiers = [_Shape(False), _Shape(True), _Shape(True, reclaims_space=True)]
    # as the default config: a TTL on the first tier only
    scheduler = Scheduler(tiers, SchedulerConfig(policy=policy), [1 << 40] * 3,
                          ttls=[5.0, None, None])
    index: dict[bytes, _Copies] = {}
    keys = [b"%016d" % i for i in range(objects)]
    for i, key in enumerate(keys):
        tier = i % 3
        parents = (keys[i - 1],) if i % CHAIN else ()
        index[key] = _Copies(key, locations=[tier])
        scheduler.admitted(tier, key, float(i) * 1e-6, parents)
    progress(f"scheduler {policy.value}", 1, 3)
    rng = random.Random(7)
    picks = [keys[rng.randrange(objects)] for _ in range(accesses)]
    now = float(objects) * 1e-6
    started = time.perf_counter()
    for key in picks:
        now += 1e-5
        scheduler.accessed(index[key].locations[0], key, now)
        scheduler.looked_up(key, True)
    per_access = (time.perf_counter() - started) / accesses
    progress(f"scheduler {policy.value}", 2, 3)
    evicted = 0
    started = time.perf_counter()
    while evicted < accesses:
        plans = scheduler.departures(0, 16, lambda _k: False, index.get)
        for plan in plans:  # as a demotion: the target copy first, then the source goes
            scheduler.admitted(1, plan.key, now)
            scheduler.removed(0, plan.key)
            index[plan.key].locations = [1]
        evicted += len(plans)
        if not plans:
            break
    per_eviction = (time.perf_counter() - started) / max(evicted, 1)
    progress(f"scheduler {policy.value}", 3, 3)
    return per_access, per_eviction


def run_scheduler_bench(*, quick: bool = False, progress: Progress = no_progress
                        ) -> tuple[dict[str, Any], list[Row]]:
    objects = 100_000 if quick else 1_000_000
    accesses = 50_000 if quick else 300_000
    lrupp = _run(EvictionPolicy.LRUPP, objects, accesses, progress)
    lru = _run(EvictionPolicy.LRU, objects, accesses, progress)
    result = {"objects": objects, "accesses": accesses,
              "lrupp_us_per_access": lrupp[0] * 1e6, "lru_us_per_access": lru[0] * 1e6,
              "lrupp_us_per_eviction": lrupp[1] * 1e6, "lru_us_per_eviction": lru[1] * 1e6}
    rows = [Row(f"scheduler: lru++ bookkeeping per access ({objects:,} objects)", "µs",
                lrupp[0] * 1e6, lru[0] * 1e6, "plain LRU", at_most=10.0),
            Row(f"scheduler: lru++ bookkeeping per eviction + demotion ({objects:,})", "µs",
                lrupp[1] * 1e6, lru[1] * 1e6, "plain LRU")]
    return result, rows
