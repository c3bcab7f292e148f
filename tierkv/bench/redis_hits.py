"""The cross-engine hit of `tierkv bench --device redis`: a block one engine put, served to
another engine on its local miss, beside a raw ``GET`` of the same server key.

Two engines in this process, A and B, each a small gpu tier on the CPU (``device = "cpu"``) over
the same redis tier (same server, same key prefix). A puts `count` distinct 64 KiB blocks and
settles (its background shares have put them on the server). Then, after one untimed warm-up
block, three reads of each block are timed one at a time, in an order that rotates from block
to block: B's `get` (its first: the local miss, the shared lookup, the adoption), the bench
tier's `fetch_many([key])` (the lookup alone) and redis-py's ``GET`` of the block's server key.
B settles after each get, untimed, so that the promotion its hit starts does not run under the
next sample; the round trips B's redis tier makes inside the gets are counted (the goal: one
per hit). B's bytes are checked against A's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tierkv.bench.common import Progress, Row, percentile
from tierkv.engine import open as open_engine
from tierkv.errors import DeviceError
from tierkv.keys import encode_key
from tierkv.tiers.redis.tier import RedisTier

SIZE = 64 << 10
SIDES = ("engine", "fetch", "raw")


async def cross_engine_hits(url: str, prefix: str, tier: RedisTier, raw: Any, *,
                            quick: bool, progress: Progress
                            ) -> tuple[list[Row], dict[str, Any]]:
    """The rows and JSON of the cross-engine hit (see the module docstring); `tier` is an open
    redis tier under `prefix` on the server at `url`, `raw` a redis-py client of it."""
    passes, count = (1, 50) if quick else (3, 200)
    config = {"tiers": [
        {"name": "gpu", "kind": "gpu", "device": "cpu", "capacity": 64 << 20,
         "slot_size": SIZE},
        {"name": "shared", "kind": "redis", "capacity": 1 << 30, "url": url,
         "key_prefix": prefix, "timeout": 30.0},
    ]}
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    round_trips = 0
    async with open_engine(config) as a, open_engine(config) as b:
        # untimed: the first call of each path pays for what it sets up once
        await a.put(b"hit-warm", bytes(SIZE))
        await a.settle()
        await b.get(b"hit-warm")
        await b.settle()
        for p in range(passes):
            value = os.urandom(SIZE)
            keys = [b"hit-%d-%d" % (p, i) for i in range(count)]
            for key in keys:
                await a.put(key, value)
            await a.settle()
            for i, key in enumerate(keys):
                canonical = encode_key(key)
                server_key = tier.server_key(canonical)
                for side in SIDES[i % 3:] + SIDES[:i % 3]:
                    before = _round_trips(b)
                    start = time.perf_counter_ns()
                    if side == "engine":
                        got: object = await b.get(key)
                    elif side == "fetch":
                        got = (await tier.fetch_many([canonical]))[0]
                    else:
                        got = await raw.get(server_key)
                    samples[side].append((time.perf_counter_ns() - start) / 1e3)
                    if side == "engine":
                        round_trips += _round_trips(b) - before
                        if got != value:
                            raise DeviceError(f"redis bench: engine B's copy of {key!r} is "
                                              "not the block engine A put")
                        await b.settle()
                    elif got is None:
                        raise DeviceError(f"redis bench: {key!r} is not on the server")
                progress("redis cross-engine hits", p * count + i + 1, passes * count)
        adopted = b.stats()["engine"].get("shared_adopted", 0) - 1  # less the warm-up's
    for series in samples.values():
        series.sort()
    hits = passes * count
    rows: list[Row] = []
    for quantile, name in ((0.50, "p50"), (0.99, "p99")):
        baseline = percentile(samples["raw"], quantile)
        rows.append(Row(f"cross-engine hit 64KiB {name}: engine B get (lower is better)", "us",
                        percentile(samples["engine"], quantile), baseline,
                        f"redis-py GET {name}"))
        rows.append(Row(f"shared lookup 64KiB {name}: fetch_many of 1 key (lower is better)",
                        "us", percentile(samples["fetch"], quantile), baseline,
                        f"redis-py GET {name}"))
    rows.append(Row("round trips per cross-engine hit", "round trips", round_trips / hits,
                    at_most=1.0))
    detail = {"hits": hits, "adopted": adopted, "round_trips": round_trips,
              **{f"{side}_us": {"p50": percentile(series, 0.50), "p99": percentile(series, 0.99),
                                "max": series[-1]}
                 for side, series in samples.items()}}
    return rows, detail


def _round_trips(engine: Any) -> int:
    return int(engine.stats()["tiers"]["shared"]["round_trips"])
