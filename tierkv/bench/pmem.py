"""`tierkv bench --device pmem`: PmemTier put/get bandwidth beside memcpy, and 4 KiB put latency.

For each object size the benchmark puts a batch of distinct keys through the `PmemTier` API, gets
them all back, and deletes them, at two queue depths: QD1 (one request at a time, each awaited
before the next) and QD`DEPTH` (`DEPTH` requests in flight from as many asyncio tasks, as fio's
iodepth). The baseline is a plain single-threaded memcpy (numpy ``copyto`` between preallocated
arrays) of the same sizes and count, measured in the same run. Each phase is repeated and the
best repetition kept for both sides alike. The pool lives in `directory` (tmpfs by default:
emulated, not real pmem) and is deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tierkv._units import format_size
from tierkv.bench.common import Progress, Row, drive, memcpy_seconds, no_progress, percentile
from tierkv.config import PmemTierConfig
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.pmem.tier import PmemTier

SIZES = (256 << 10, 1 << 20, 4 << 20)
TARGET = 0.70
LATENCY_SIZE = 4 << 10
#: requests in flight in the concurrent case
DEPTH = 8


def _meta(size: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), size, 1)


async def _tier_seconds(tier: PmemTier, size: int, count: int, depth: int) -> tuple[float, float]:
    data = memoryview(os.urandom(size))
    meta = _meta(size)
    keys = [b"\x02bench-%d" % i for i in range(count)]

    async def put(key: bytes) -> None:
        await tier.put(key, meta, data)

    async def get(key: bytes) -> None:
        got = await tier.get(key)
        if got is None or len(got[1]) != size:
            raise RuntimeError("a benchmark object was lost")

    put_seconds = await drive(keys, depth, put)
    get_seconds = await drive(keys, depth, get)
    for key in keys:
        await tier.delete(key)
    return put_seconds, get_seconds


async def run_pmem_bench(directory: Path, *, quick: bool = False,
                         progress: Progress = no_progress, native: bool = True
                         ) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); JSON-able result with "rows".

    `native=False` measures the tier's Python copy path (what runs without the native library),
    for comparisons; the CLI always measures the tier as it runs by default."""
    capacity = (256 if quick else 1024) << 20
    batch_bytes = (32 if quick else 128) << 20
    repeats = 3 if quick else 5
    latency_count = 1000 if quick else 5000
    path = directory / f"tierkv-bench-{uuid.uuid4().hex}.pool"
    tier = PmemTier(PmemTierConfig("bench", capacity, path), native=native)
    rows: list[Row] = []
    total = len(SIZES) * repeats + 1
    done = 0
    try:
        await tier.open()
        describe = tier.describe()
        for size in SIZES:
            count = max(4, batch_bytes // size)
            best: dict[str, float] = {}
            for _ in range(repeats):
                for depth in (1, DEPTH):
                    put, get = await _tier_seconds(tier, size, count, depth)
                    _keep_best(best, f"put{depth}", put)
                    _keep_best(best, f"get{depth}", get)
                for way in ("scatter", "gather"):
                    _keep_best(best, way, memcpy_seconds(size, count, scatter=way == "scatter"))
                done += 1
                progress("bandwidth", done, total)
            moved = size * count / 1e9
            label = format_size(size)
            for depth in (1, DEPTH):
                # the bandwidth target is judged with requests in flight, as a device's (fio's
                # iodepth); one request at a time is reported beside it: it measures the two
                # thread hand-offs a copy kept off the event loop costs (docs/benchmarks-pmem.md)
                target = TARGET if depth == DEPTH else None
                rows.append(Row(f"put {label} QD{depth}", "GB/s", moved / best[f"put{depth}"],
                                moved / best["scatter"], "memcpy 1 source -> N slots", target))
                rows.append(Row(f"get {label} QD{depth}", "GB/s", moved / best[f"get{depth}"],
                                moved / best["gather"], "memcpy N slots -> 1 target", target))
        samples = await _put_latencies(tier, latency_count)
        done += 1
        progress("latency", done, total)
        copy_us = (memcpy_seconds(LATENCY_SIZE, latency_count, scatter=True)
                   / latency_count * 1e6)
        rows.append(Row("put 4KiB p50 (lower is better)", "us", percentile(samples, 0.50),
                        copy_us, "memcpy 4KiB mean"))
        rows.append(Row("put 4KiB p99 (lower is better)", "us", percentile(samples, 0.99),
                        copy_us, "memcpy 4KiB mean"))
    finally:
        await tier.close()
        path.unlink(missing_ok=True)
    return {
        "device": "pmem",
        "pool_directory": str(directory),
        "media": describe,
        "copy_path": describe.get("copies", ""),
        "quick": quick,
        "depth": DEPTH,
        "rows": [row.to_json() for row in rows],
    }


def _keep_best(best: dict[str, float], name: str, seconds: float) -> None:
    best[name] = min(best.get(name, float("inf")), seconds)


async def _put_latencies(tier: PmemTier, count: int) -> list[float]:
    data = memoryview(os.urandom(LATENCY_SIZE))
    meta = _meta(LATENCY_SIZE)
    samples = []
    for i in range(count):
        key = b"\x02lat-%d" % (i % 512)
        start = time.perf_counter_ns()
        await tier.put(key, meta, data)
        samples.append((time.perf_counter_ns() - start) / 1e3)
    for i in range(min(count, 512)):
        await tier.delete(b"\x02lat-%d" % i)
    samples.sort()
    return samples


def render_pmem_report(result: dict[str, Any]) -> list[str]:
    """The result as text lines: media, then one table row per figure."""
    lines = [f"pmem benchmark (pool in {result['pool_directory']}"
             f"{', quick' if result.get('quick') else ''})"]
    lines += [f"  {key}: {value}" for key, value in result.get("media", {}).items()]
    lines.append(f"  {'case':<32} {'measured':>10} {'baseline':>10} {'ratio':>7}  target")
    for row in result["rows"]:
        baseline = "" if row["baseline"] is None else f"{row['baseline']:.3g}"
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
        target = ""
        if row["target"] is not None:
            target = f">= {row['target']:.2f} " + ("met" if row["meets_target"] else "NOT met")
        lines.append(f"  {row['case']:<32} {row['measured']:>10.3g} {baseline:>10} {ratio:>7}  "
                     f"{target}  [{row['unit']}; baseline: {row['baseline_name']}]")
    return lines


async def compare_copy_paths(directory: Path, rounds: int) -> list[dict[str, Any]]:
    """`rounds` full runs of each copy path (native, Python), alternating which goes first."""
    results = []
    for n in range(rounds):
        for native in (True, False) if n % 2 == 0 else (False, True):
            result = await run_pmem_bench(directory, native=native)
            results.append({"native": native, "round": n, "rows": result["rows"]})
            print(("native " if native else "python ") + " | ".join(
                f"{row['case']} {row['ratio']:.2f}" if row["unit"] == "GB/s"
                else f"{row['case']} {row['measured']:.1f}{row['unit']}"
                for row in result["rows"]), flush=True)
    return results


def _main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tierkv.bench.pmem",
        description="The pmem tier's bench; --compare runs the native and Python copy paths "
                    "alternately (docs/benchmarks.md).")
    parser.add_argument("directory", type=Path, nargs="?", default=Path("/dev/shm"))
    parser.add_argument("--compare", type=int, metavar="ROUNDS", default=0,
                        help="ROUNDS full runs of each copy path, alternating")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args(argv)
    if args.compare:
        results: Any = asyncio.run(compare_copy_paths(args.directory, args.compare))
    else:
        results = asyncio.run(run_pmem_bench(args.directory))
        print("\n".join(render_pmem_report(results)))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    _main(sys.argv[1:])
