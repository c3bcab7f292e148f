"""Replay of a real KV-cache request trace through the engine, under prefix semantics.

The trace (the Mooncake conversation trace format: one JSON object per line with ``hash_ids``,
one id per 512-token block of the prompt, ids chained so that equal leading runs mean equal
prefixes) is replayed request by request, as an inference server would: `get_many` over the
request's block keys, the leading run of hits is what the cache serves (block i is only usable
when blocks 0..i-1 are), and the blocks from the first miss on are computed and `put`. Values are
`block_bytes` of random data, a scaled-down stand-in for the real KV block.

Reported: block hit ratio, hits per tier, bytes demoted between tiers, and the request latency of
the lookup; the README of the trace gives LRU and Belady reference hit ratios by capacity.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tierkv.bench.common import Progress, Row, no_progress, percentile
from tierkv.engine import Engine
from tierkv.keys import BlockKey

TRACE_BLOCK_TOKENS = 512


def read_trace(path: Path, limit: int | None = None) -> Iterator[list[int]]:
    """The ``hash_ids`` of each request of a JSON-lines trace, in order."""
    with path.open() as lines:
        for number, line in enumerate(lines):
            if limit is not None and number >= limit:
                return
            record = json.loads(line)
            ids = record.get("hash_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError(f"{path}:{number + 1}: no list of integer hash_ids")
            yield ids


def block_key(hash_id: int, position: int) -> BlockKey:
    digest = hashlib.sha256(b"tierkv.trace\x00" + hash_id.to_bytes(8, "little")).digest()
    return BlockKey(digest[:16], (position + 1) * TRACE_BLOCK_TOKENS, 10000.0)


async def replay(
    kv: Engine, requests: list[list[int]], *, block_bytes: int, progress: Progress = no_progress
) -> tuple[dict[str, Any], list[Row]]:
    """Replay `requests` (the hash ids of each, as `read_trace` yields them) through `kv`."""
    value = os.urandom(block_bytes)
    references = served = puts = 0
    lookup_ns: list[int] = []
    before = kv.stats()["engine"]
    started = time.perf_counter()
    for number, ids in enumerate(requests):
        keys = [block_key(hash_id, position) for position, hash_id in enumerate(ids)]
        t0 = time.perf_counter_ns()
        found = await kv.get_many(keys)
        lookup_ns.append(time.perf_counter_ns() - t0)
        prefix = next((i for i, got in enumerate(found) if got is None), len(keys))
        references += len(keys)
        served += prefix
        for key in keys[prefix:]:
            await kv.put(key, value)
            puts += 1
        if number % 50 == 0:
            progress("trace replay", number, len(requests))
    elapsed = time.perf_counter() - started
    progress("trace replay", len(requests), len(requests))
    after = kv.stats()["engine"]
    hits = {t: n - before["hits"].get(t, 0) for t, n in after["hits"].items()}
    demotions = {t: n - before["demotions"].get(t, 0) for t, n in after["demotions"].items()}
    lookups = sorted(ns / 1000 for ns in lookup_ns)
    hit_ratio = served / references if references else 0.0
    result = {
        "requests": len(requests),
        "block_references": references,
        "blocks_served": served,
        "block_hit_ratio": hit_ratio,
        "blocks_put": puts,
        "block_bytes": block_bytes,
        "hits_by_tier": hits,
        "demotions_by_tier": demotions,
        "demoted_bytes": sum(demotions.values()) * block_bytes,
        "lookup_p50_us": percentile(lookups, 0.5),
        "lookup_p99_us": percentile(lookups, 0.99),
        "requests_per_s": len(requests) / elapsed if elapsed else 0.0,
    }
    rows = [
        Row(f"trace: block hit ratio ({len(requests)} requests)", "ratio", hit_ratio),
        Row("trace: get_many lookup p50", "µs", result["lookup_p50_us"]),
        Row("trace: get_many lookup p99", "µs", result["lookup_p99_us"]),
        Row("trace: requests replayed", "req/s", result["requests_per_s"]),
    ]
    return result, rows
