"""Invalidating a subtree of 100 k objects spread over the tiers, beside deleting them one by one.

A root key with `chains` chains of `depth` blocks under it (`put(parents=...)`), 4 KiB values, put
through the configured hierarchy resized (as the trace replay does: 20 / 30 / 50 %) so that they
spread over all its tiers without any being dropped. Timed: `invalidate(root)`, which walks the
DAG and removes every descendant durably (the persistent tiers are synced before it returns).
Baseline, on a second copy of the same objects in the same engine: `delete` of each key, in the
same order, then one `flush`: the same device work, with the keys named by the caller instead of
found in the DAG.
"""

from __future__ import annotations

import time
from typing import Any

from tierkv.bench.common import Progress, Row, no_progress
from tierkv.bench.trace_config import ReplayPolicy, capacity_point
from tierkv.config import Config
from tierkv.engine import open as open_engine

VALUE = bytes(4096)


async def _build(kv: Any, prefix: bytes, chains: int, depth: int,
                 progress: Progress) -> list[bytes]:
    root = prefix + b"root"
    await kv.put(root, VALUE)
    keys = [root]
    for c in range(chains):
        parent = root
        for d in range(depth):
            key = prefix + b"%d.%d" % (c, d)
            await kv.put(key, VALUE, parents=(parent,))
            keys.append(key)
            parent = key
        progress(f"invalidation: put {prefix.decode()}", c + 1, chains)
    await kv.settle()
    return keys


async def run_invalidation_bench(config: Config, *, quick: bool = False,
                                 progress: Progress = no_progress
                                 ) -> tuple[dict[str, Any], list[Row]]:
    chains, depth = (20, 250) if quick else (100, 1000)
    # sized so that both copies fill the tiers 20/30/50 and nothing is dropped
    total = int(1.3 * 2 * (chains * depth + 1) * len(VALUE) * 1.1)
    with capacity_point(config, total, len(VALUE), ReplayPolicy.TIERKV) as (sized, _):
        return await _measure(sized, chains, depth, progress)


async def _measure(config: Config, chains: int, depth: int, progress: Progress
                   ) -> tuple[dict[str, Any], list[Row]]:
    async with open_engine(config) as kv:
        subtree = await _build(kv, b"inv.", chains, depth, progress)
        others = await _build(kv, b"del.", chains, depth, progress)
        where = {name: stats.get("objects", stats.get("entries", 0))
                 for name, stats in kv.stats()["tiers"].items()}
        started = time.perf_counter()
        removed = await kv.invalidate(subtree[0])
        invalidate_s = time.perf_counter() - started
        started = time.perf_counter()
        deleted = 0
        for key in others:
            deleted += await kv.delete(key)
        await kv.flush()
        delete_s = time.perf_counter() - started
    result = {"objects": len(subtree), "removed": removed, "deleted": deleted,
              "invalidate_s": invalidate_s, "delete_s": delete_s,
              "invalidate_objects_per_s": removed / invalidate_s,
              "delete_objects_per_s": deleted / delete_s, "objects_by_tier_before": where}
    rows = [Row(f"invalidate a {len(subtree):,}-object subtree", "objects/s",
                removed / invalidate_s, deleted / delete_s, "delete each + flush")]
    return result, rows
