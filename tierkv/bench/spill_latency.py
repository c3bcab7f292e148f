"""Put latency through a full hierarchy: what a writer waits for while the tiers spill.

One task puts 16 KiB objects (a KV block) into gpu 1 MiB → pmem 8 MiB → nvme 32 MiB, four
times what they hold, so that nearly every put after the first few hundred waits for room: for
the gpu tier's demotion into the pool, which waits for the pool's demotion into the log, which
frees its source only once a flush of the log has put the copy on media. Those flushes linger
(`engine.demotion_linger`) for more demotions to share them — except while a put waits for the
room they free. The case runs the same puts with the configured linger beside a linger of 0
(each demotion's flush starts at once), in one run, alternating, best of `repeats` on each side:
the p99 ratio says what the linger costs a waiting writer (1: nothing), the rate ratio what it
gains. Python's full garbage collections pause the loop, so the longest one during the run is
reported beside the slowest put (the tail that is not the engine's waits), and a third variant
freezes the heap after open (`gc.freeze`, as docs/architecture.md advises an embedding server)
to show what that leaves of it.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from tierkv.bench.common import Progress, Row, no_progress, percentile
from tierkv.bench.engine_core import Places, scratch
from tierkv.config import Config
from tierkv.engine import open

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 16 * KiB


@dataclass(frozen=True, slots=True)
class _Variant:
    name: str
    linger: float
    frozen: bool = False


@dataclass(slots=True)
class _Run:
    p99_ms: float
    max_ms: float
    puts_per_s: float
    longest_full_gc_ms: float
    #: objects the pool moved into the log: the puts did wait for the whole hierarchy
    into_log: int


@contextmanager
def _full_collections() -> Iterator[list[float]]:
    """The pauses (ms) of the full (generation 2) collections that run inside the block."""
    pauses: list[float] = []
    started = 0.0

    def watch(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if info["generation"] != 2:
            return
        if phase == "start":
            started = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started) * 1e3)

    gc.callbacks.append(watch)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(watch)


@contextmanager
def _frozen_heap(freeze: bool) -> Iterator[None]:
    """With `freeze`, the objects alive now (the interpreter's, torch's, the open engine's) are
    moved out of the collector's sight for the block (`gc.freeze`), as a server does after it
    has loaded its model; they are handed back after."""
    if not freeze:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _run(places: Places, variant: _Variant, count: int) -> _Run:
    assert places.device and places.pmem_dir and places.nvme_dir
    value = os.urandom(BLOCK)
    samples: list[float] = []
    with scratch(places.pmem_dir, ".pool") as pool, scratch(places.nvme_dir, ".log") as log:
        config = {"engine": {"demotion_linger": variant.linger}, "tiers": [
            {"name": "gpu", "kind": "gpu", "device": places.device, "capacity": MiB,
             "slot_size": BLOCK, "ttl": "1h"},
            {"name": "pmem", "kind": "pmem", "path": str(pool), "capacity": 8 * MiB,
             "format": True},
            {"name": "nvme", "kind": "nvme", "path": str(log), "capacity": 32 * MiB,
             "region_size": MiB, "format": True}]}
        async with open(config) as kv:
            with _frozen_heap(variant.frozen), _full_collections() as pauses:
                for i in range(count):
                    started = time.perf_counter()
                    await kv.put(b"spill-%d" % i, value)
                    samples.append(time.perf_counter() - started)
            into_log = kv.stats()["engine"]["demotions"].get("nvme", 0)
    samples.sort()
    return _Run(percentile(samples, 0.99) * 1e3, samples[-1] * 1e3, count / sum(samples),
                max(pauses, default=0.0), into_log)


def _best(done: list[_Run]) -> _Run:
    """The best p99 and rate over the repeats; the slowest put of them all, with its own run's
    longest pause (a full collection comes every few thousand puts: the best run's slowest put
    was often one that had none, which hid it)."""
    tail = max(done, key=lambda run: run.max_ms)
    return _Run(min(run.p99_ms for run in done), tail.max_ms,
                max(run.puts_per_s for run in done), tail.longest_full_gc_ms,
                min(run.into_log for run in done))


async def put_latency_while_spilling(config: Config, *, quick: bool = False, repeats: int = 3,
                                     progress: Progress = no_progress
                                     ) -> tuple[dict[str, Any], list[Row]]:
    places = Places.of(config)
    if places.device is None or places.pmem_dir is None or places.nvme_dir is None:
        return {"skipped": "needs a gpu, a pmem and an nvme tier in the config"}, []
    count = 2000 if quick else 4000
    linger = config.engine.demotion_linger
    variants = (_Variant("linger", linger), _Variant("no linger", 0.0),
                _Variant("linger, heap frozen", linger, frozen=True))
    runs: dict[_Variant, list[_Run]] = {variant: [] for variant in variants}
    for repeat in range(repeats):
        progress("put latency while spilling", repeat, repeats)
        for variant, done in runs.items():
            done.append(await _run(places, variant, count))
    progress("put latency while spilling", repeats, repeats)
    plain, no_linger, frozen = (_best(runs[variant]) for variant in variants)
    shape = f"16KiB x {count}, 1 task, gpu 1MiB -> pmem 8MiB -> nvme 32MiB"
    linger_ms = f"demotion_linger {linger * 1e3:g}ms"
    rows = [
        Row(f"put p99 {shape}, {linger_ms} (ratio: lower is better)", "ms",
            plain.p99_ms, baseline=no_linger.p99_ms, baseline_name="demotion_linger 0"),
        Row(f"put rate {shape}, {linger_ms}", "puts/s",
            plain.puts_per_s, baseline=no_linger.puts_per_s, baseline_name="demotion_linger 0"),
        Row(f"slowest put {shape}, {linger_ms}", "ms", plain.max_ms,
            baseline=plain.longest_full_gc_ms,
            baseline_name="longest full garbage collection in the same run"),
        Row(f"slowest put {shape}, {linger_ms}, heap frozen after open (ratio: lower is better)",
            "ms", frozen.max_ms, baseline=plain.max_ms, baseline_name="heap not frozen"),
    ]
    return {"linger_s": linger, "count": count,
            "runs": {variant.name: [asdict(run) for run in done]
                     for variant, done in runs.items()}}, rows
