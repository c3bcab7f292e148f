"""`tierkv bench --device nvme`: the NVMe tier beside fio and beside one-file-per-object aiofiles.

The virtio disk of the VM this was written on is backed by the host's cache, and the same fio job
moves up to 2x from one run to the next, so every fio-relative case runs as K pairs (3 quick,
5 full) and its row is the pair whose ratio is the median: `measured` and `baseline` are that
pair's tier and fio figures (not the medians of each side, which could come from different
runs), and the case text and the JSON carry K and the range of the ratios. All on one file:
fio (``--ioengine=io_uring --direct=1``, same block size, ``--iodepth=32``) measures the device,
the tier is formatted on that file and driven through the `NvmeTier` API by `QUEUE_DEPTH`
asyncio tasks (fill to 85 %, then every object read once). A pair's round (`_round`) flanks one
tier run with the fio jobs, each next to the tier phase it is set against: fio write, tier
(write, read), fio read in even rounds, the mirror image in odd ones, so each case alternates
which side goes first. The sequential 1 MiB write baseline writes the tier fill's bytes once
with ``--end_fsync=1`` (as the tier's figure counts its closing `flush()`), and so does the random
1 MiB write baseline (the same bytes, each block once in random order); the read jobs are
time-based over the whole file. The file is laid out whole by fio first (not
counted), so every write overwrites allocated blocks.

Next to every random-order tier run (1 MiB, 64 KiB, 4 KiB), after it in even rounds and before
it in odd ones, a directory of as many files, one per object, is written and read back with
aiofiles (buffered IO, page cache dropped per file with ``POSIX_FADV_DONTNEED`` after a sync, so
its reads are cold); those K pairs make the "tier vs file per object" rows, like the fio ones.
Index memory per entry is measured over `NvmeIndex` holding 1 M entries of 33-byte keys (a
`BlockKey`'s canonical size): in full mode by tracemalloc over building it (every allocation the
index makes, keys included), in both modes by `NvmeIndex.memory_bytes()` (getsizeof of its
containers; the index has no per-entry Python objects, so the two agree; tracemalloc alone takes
~40 s).

`run_nvme_bench` returns JSON-able data: ``rows`` (`Row.to_json()` dicts; paired rows add
``pairs``, ``min_ratio`` and ``max_ratio``), ``pairs`` (per case: every pair's figures, ratio and
order), ``config`` (sizes, durations, K, paths) and ``fio`` (raw fio figures per job, in run
order). `nvme_rows(result)` turns ``rows`` back into `Row` objects. Every bench file is deleted
afterwards. Run the full bench with ``python -m tierkv.bench.nvme DIRECTORY`` (``--quick`` for
the short one); ``--seq-pairs N`` runs only `seq_write_pairs` (N sequential-fill pairs).
"""


from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import shutil
import statistics
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from tierkv._units import parse_duration
from tierkv.bench.common import Progress, Row, no_progress
from tierkv.bench.nvme_baselines import _FIO_NAME, FioJob, _fio, _fio_fill
from tierkv.bench.nvme_pairs import (
    _bytes_pair,
    _FilesPair,
    _median_pair,
    _Pair,
    _pair_row,
    _Round,
    _round,
    _with_files,
)
from tierkv.bench.nvme_tier_runs import (
    _FULL,
    _QUICK,
    INDEX_ENTRIES,
    QUEUE_DEPTH,
    GiB,
    KiB,
    MiB,
    _fill_count,
    _Plan,
    _tier_run,
    index_bytes_per_entry,
)
from tierkv.errors import ConfigError

#: the bench's entry points, and the parts its tests drive one by one (`_round`, `_pair_row`, ...)
__all__ = [
    "INDEX_ENTRIES",
    "QUEUE_DEPTH",
    "FioJob",
    "GiB",
    "KiB",
    "MiB",
    "_Pair",
    "_Plan",
    "_Round",
    "_fill_count",
    "_fio",
    "_fio_fill",
    "_median_pair",
    "_pair_row",
    "_round",
    "_tier_run",
    "_with_files",
    "index_bytes_per_entry",
    "nvme_rows",
    "render_nvme_report",
    "run_nvme_bench",
    "seq_write_pairs",
]


async def run_nvme_bench(directory: Path, *, quick: bool = False,
                         progress: Progress = no_progress, pairs: int | None = None,
                         sq_poll: float | None = None) -> dict[str, Any]:
    """Run the benchmark under `directory` (see the module docstring for what and how).

    `pairs`: fio/tier pairs per fio-relative case (default 3 quick, 5 full). `sq_poll`: run the
    tier with io_uring submission-queue polling (`NvmeTierConfig.sq_poll`); fio is unchanged.
    """
    plan = dataclasses.replace(_QUICK if quick else _FULL, sq_poll=sq_poll)
    k = pairs if pairs is not None else plan.pairs
    if k < 1:
        raise ConfigError(f"pairs must be at least 1, got {k}")
    os.makedirs(directory, exist_ok=True)
    path = directory / "tierkv-bench.nvme"
    files_dir = directory / "tierkv-bench-files"
    rows: list[Row] = []
    details: list[dict[str, Any]] = []
    extras: dict[str, dict[str, Any]] = {}  # by row case: K and the ratio range
    fio: dict[str, list[dict[str, float]]] = {}
    steps = 3 + 4 * k
    done = 0

    def step(name: str) -> None:
        nonlocal done
        done += 1
        progress(name, done, steps)

    def add(case: str, unit: str, case_pairs: list[_Pair], target: float | None,
            baseline: str = _FIO_NAME) -> None:
        row, detail = _pair_row(case, unit, case_pairs, target, baseline)
        rows.append(row)
        details.append(detail)
        extras[row.case] = {"pairs": detail["pairs"], "min_ratio": detail["min_ratio"],
                            "max_ratio": detail["max_ratio"]}

    def job(name: str, run: FioJob) -> FioJob:
        def recorded() -> dict[str, float]:
            figures = run()
            fio.setdefault(name, []).append(figures)
            return figures
        return recorded

    def tier(size: int, random_order: bool) -> Callable[[], Awaitable[dict[str, float]]]:
        return functools.partial(_tier_run, path, size, plan, random_order=random_order,
                                 reads=True)

    def files_count(size: int) -> int:
        """As many files as the tier run puts objects, up to the plan's cap."""
        return min(_fill_count(path, size, plan), plan.files_cap)

    def fio_time_based(rw: str, bs: int) -> FioJob:
        label = f"{bs // KiB}KiB" if bs < MiB else "1MiB"
        return job(f"{rw} {label}", functools.partial(_fio, path, rw, bs, plan.file_size,
                                                      plan.fio_seconds))

    try:
        loop = asyncio.get_running_loop()
        # every later write overwrites allocated blocks, the tier's and fio's alike (not counted)
        await loop.run_in_executor(None, _fio_fill, path, plan.file_size)
        step("fio lays out the file")
        # like for like with the tier's fill: same bytes, sequential 1 MiB, ends with an fsync
        fill_bytes = _fill_count(path, MiB, plan) * MiB
        fill = job("write 1MiB", functools.partial(_fio_fill, path, fill_bytes))
        random_fill = job("randwrite 1MiB",
                          functools.partial(_fio_fill, path, fill_bytes, "randwrite"))
        seq_rounds = []
        for n in range(k):
            seq_rounds.append(await _round(n, tier(MiB, False), fio_time_based("read", MiB), fill))
            step(f"sequential 1MiB pair {n + 1}/{k}")
        rnd_rounds = []
        files: dict[int, list[_FilesPair]] = {MiB: [], 64 * KiB: [], 4 * KiB: []}
        for n in range(k):
            files[MiB].append(await _with_files(
                n, _round(n, tier(MiB, True), fio_time_based("randread", MiB),
                          random_fill), files_dir, MiB, files_count(MiB)))
            rnd_rounds.append(files[MiB][-1].round)
            step(f"random 1MiB pair {n + 1}/{k}")
        for case, rounds, key in (("seq write 1MiB QD32", seq_rounds, "write"),
                                  ("seq read 1MiB QD32", seq_rounds, "read"),
                                  ("rand write 1MiB QD32", rnd_rounds, "write"),
                                  ("rand read 1MiB QD32", rnd_rounds, "read")):
            add(case, "MB/s", [_bytes_pair(r, key) for r in rounds], 0.9)
        for size, goal in ((64 * KiB, 0.6), (4 * KiB, None)):
            label = f"{size // KiB}KiB"
            small = []
            for n in range(k):
                files[size].append(await _with_files(
                    n, _round(n, tier(size, True), fio_time_based("randread", size)),
                    files_dir, size, files_count(size)))
                small.append(files[size][-1].round)
                step(f"random {label} pair {n + 1}/{k}")
            read_pairs = [_Pair(r.tier["read_iops"], r.fio_read["iops"], r.read_fio_first)
                          for r in small]
            add(f"rand read {label} QD32", "IOPS", read_pairs, goal)
        path.unlink(missing_ok=True)
        # each tier run against the one-file-per-object run made right before or after it
        for size, size_pairs in files.items():
            label = f"{size // KiB}KiB" if size < MiB else "1MiB"
            count = int(size_pairs[0].files["objects"])
            for side, what in (("write", f"aiofiles, {count} files"),
                               ("read", f"aiofiles, {count} files, cold")):
                verb = "write" if side == "write" else "rand read"
                add(f"{verb} {label}: tier vs file per object", "MB/s",
                    [pair.bytes_pair(side) for pair in size_pairs], None, what)
        step("aiofiles one file per object")
        sized = await loop.run_in_executor(
            None, functools.partial(index_bytes_per_entry, INDEX_ENTRIES, traced=False))
        rows.append(Row("index memory per entry (1M entries, 33-byte keys, getsizeof)",
                        "bytes", sized, at_most=100.0))
        if not quick:
            traced = await loop.run_in_executor(None, index_bytes_per_entry, INDEX_ENTRIES)
            rows.append(Row("index memory per entry (1M entries, 33-byte keys, tracemalloc)",
                            "bytes", traced, at_most=100.0))
        step("index memory")
    finally:
        path.unlink(missing_ok=True)
        shutil.rmtree(files_dir, ignore_errors=True)
    return {
        "rows": [row.to_json() | extras.get(row.case, {}) for row in rows],
        "pairs": details,
        "fio": fio,
        "config": {"quick": quick, "file_size": plan.file_size, "region_size": plan.region_size,
                   "queue_depth": QUEUE_DEPTH, "fio_seconds": plan.fio_seconds,
                   "pairs": k, "directory": str(directory), "sq_poll": plan.sq_poll},
    }


async def seq_write_pairs(directory: Path, pairs: int, *, quick: bool = False
                          ) -> dict[str, Any]:
    """`pairs` back-to-back sequential 1 MiB fills: fio (`_fio_fill`) and the tier, same bytes.

    The file is written once whole by fio first (not counted), so every fill overwrites
    allocated blocks; the order inside a pair alternates so drift favours neither. Returns the
    MB/s of each, the per-pair ratios, their median and range.
    """
    plan = _QUICK if quick else _FULL
    os.makedirs(directory, exist_ok=True)
    path = directory / "tierkv-bench.nvme"
    loop = asyncio.get_running_loop()
    nbytes = _fill_count(path, MiB, plan) * MiB
    fio_mbs: list[float] = []
    tier_mbs: list[float] = []
    try:
        await loop.run_in_executor(None, _fio_fill, path, plan.file_size)
        for n in range(pairs):
            for first in ((True, False) if n % 2 == 0 else (False, True)):
                if first:
                    result = await loop.run_in_executor(None, _fio_fill, path, nbytes)
                    fio_mbs.append(result["bytes_per_s"] / 1e6)
                else:
                    tier = await _tier_run(path, MiB, plan, random_order=False, reads=False)
                    tier_mbs.append(tier["write_bytes_per_s"] / 1e6)
    finally:
        path.unlink(missing_ok=True)
    ratios = [t / f for t, f in zip(tier_mbs, fio_mbs, strict=True)]
    return {"tier_mb_s": tier_mbs, "fio_mb_s": fio_mbs, "ratios": ratios,
            "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
            "max_ratio": max(ratios), "bytes": nbytes}


def nvme_rows(result: dict[str, Any]) -> list[Row]:
    """The `Row` objects of a `run_nvme_bench` result."""
    names = [f.name for f in dataclasses.fields(Row)]
    return [Row(**{n: row[n] for n in names if n in row}) for row in result["rows"]]


def render_nvme_report(result: dict[str, Any]) -> list[str]:
    """Plain text lines: one per row, figure, baseline, ratio and target."""
    config = result["config"]
    rows = nvme_rows(result)
    width = max([len("case"), *(len(row.case) for row in rows)])
    lines = [
        f"NVMe tier benchmark ({'quick' if config['quick'] else 'full'}): file "
        f"{config['file_size'] / GiB:.2f} GiB, region {config['region_size'] // MiB} MiB, "
        f"QD {config['queue_depth']}",
        f"{'case':<{width}} {'tier':>10} {'baseline':>10} {'ratio':>7} {'target':>7}  baseline",
    ]
    for row in rows:
        baseline = f"{row.baseline:10.1f}" if row.baseline is not None else f"{'-':>10}"
        ratio = f"{row.ratio:7.2f}" if row.ratio is not None else f"{'-':>7}"
        target = f"{row.target:7.2f}" if row.target is not None else f"{'-':>7}"
        mark = {True: " ok", False: " MISS", None: ""}[row.meets_target]
        lines.append(f"{row.case:<{width}} {row.measured:10.1f} {baseline} {ratio} {target}  "
                     f"{row.unit}, {row.baseline_name or 'no baseline'}{mark}")
    return lines


def _main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.nvme",
                                     description="The NVMe tier beside fio on one file.")
    parser.add_argument("directory", type=Path, help="where the bench file is made (and removed)")
    parser.add_argument("--quick", action="store_true", help="a smaller, shorter run")
    parser.add_argument("--seq-pairs", type=int, default=0, metavar="N",
                        help="only run N fio/tier sequential-fill pairs")
    parser.add_argument("--sq-poll", type=parse_duration, default=None, metavar="DURATION",
                        help="run the tier with io_uring submission-queue polling, e.g. 2ms")
    options = parser.parse_args(argv)
    quick, pairs, directory = options.quick, options.seq_pairs, options.directory
    if pairs:
        data = asyncio.run(seq_write_pairs(directory, pairs, quick=quick))
        for n, (t, f, r) in enumerate(zip(data["tier_mb_s"], data["fio_mb_s"], data["ratios"],
                                          strict=True)):
            print(f"pair {n + 1}: tier {t:7.0f} MB/s  fio {f:7.0f} MB/s  ratio {r:.2f}")
        print(f"median ratio {data['median_ratio']:.2f} (range {data['min_ratio']:.2f}-"
              f"{data['max_ratio']:.2f}) over {pairs} pairs of {data['bytes'] // MiB} MiB fills")
        return
    result = asyncio.run(run_nvme_bench(directory, quick=quick, sq_poll=options.sq_poll))
    for line in render_nvme_report(result):
        print(line)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    _main(sys.argv[1:])
