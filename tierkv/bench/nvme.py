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
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiofiles

from tierkv._units import parse_duration
from tierkv.bench.common import Progress, Row, no_progress
from tierkv.config import NvmeBackend, NvmeTierConfig
from tierkv.errors import ConfigError
from tierkv.formats.value import ObjectMeta, ValueKind

QUEUE_DEPTH = 32
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
INDEX_ENTRIES = 1_000_000
_FIO_NAME = "fio io_uring O_DIRECT"
#: one fio job, run in an executor thread; its figures ("bytes_per_s", "iops")
FioJob = Callable[[], dict[str, float]]


@dataclass(frozen=True, slots=True)
class _Plan:
    file_size: int
    region_size: int
    fio_seconds: int
    files_cap: int
    pairs: int
    #: the tier's `sq_poll` (io_uring submission-queue polling); None: off, the default
    sq_poll: float | None = None


_QUICK = _Plan(file_size=256 * MiB, region_size=32 * MiB, fio_seconds=1, files_cap=2048, pairs=3)
_FULL = _Plan(file_size=3 * GiB // 2, region_size=64 * MiB, fio_seconds=4, files_cap=16384,
              pairs=5)


# -- fio -----------------------------------------------------------------------------------------
def _fio(path: Path, rw: str, bs: int, size: int, seconds: int) -> dict[str, float]:
    """fio for `seconds` over the first `size` bytes of `path` (no fsync)."""
    return _fio_job(path, rw, bs, [f"--size={size}", f"--runtime={seconds}", "--time_based"])


def _fio_fill(path: Path, nbytes: int, rw: str = "write") -> dict[str, float]:
    """fio writing `nbytes` once in 1 MiB blocks (`rw`: in order, or "randwrite": each block
    once in random order), then fsync, like a tier fill.

    ``--end_fsync=1`` is counted in fio's runtime (as the tier's closing `flush()` is in its).
    """
    return _fio_job(path, rw, MiB, [f"--size={nbytes}", "--end_fsync=1"])


def _fio_job(path: Path, rw: str, bs: int, extra: list[str]) -> dict[str, float]:
    cmd = [
        "fio", "--name=tierkv", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
        f"--rw={rw}", f"--bs={bs}", f"--iodepth={QUEUE_DEPTH}", *extra, "--group_reporting",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, check=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if "write" in rw else "read"]
    return {"bytes_per_s": float(side["bw_bytes"]), "iops": float(side["iops"])}


# -- the tier ------------------------------------------------------------------------------------
def _meta(size: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), size, 1)


def _key(i: int) -> bytes:
    return b"\x02bench-" + i.to_bytes(8, "little")


async def _drive(count: int, op: Callable[[int], Awaitable[None]], order: Sequence[int]) -> float:
    """Run `op` over `order` with QUEUE_DEPTH tasks; seconds taken."""
    position = 0

    async def worker() -> None:
        nonlocal position
        while position < count:
            i = order[position]
            position += 1
            await op(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(QUEUE_DEPTH)))
    return time.perf_counter() - start


def _tier_config(path: Path, plan: _Plan) -> NvmeTierConfig:
    return NvmeTierConfig(name="bench", capacity=plan.file_size, path=path,
                          region_size=plan.region_size, queue_depth=QUEUE_DEPTH,
                          backend=NvmeBackend.AUTO, reinsert_hits=0, format=True,
                          sq_poll=plan.sq_poll)


def _fill_count(path: Path, size: int, plan: _Plan) -> int:
    """How many objects of `size` bytes a tier run puts: 85 % of the capacity."""
    from tierkv.tiers.nvme.tier import NvmeTier

    tier = NvmeTier(_tier_config(path, plan))  # never opened: geometry only
    return int(tier.capacity * 0.85) // tier.footprint(size)


async def _tier_run(path: Path, size: int, plan: _Plan, *, random_order: bool,
                    reads: bool) -> dict[str, float]:
    from tierkv.tiers.nvme.tier import NvmeTier

    tier = NvmeTier(_tier_config(path, plan))
    await tier.open()
    try:
        count = int(tier.capacity * 0.85) // tier.footprint(size)
        payload = memoryview(os.urandom(size))
        meta = _meta(size)
        order = list(range(count))
        if random_order:
            random.Random(7).shuffle(order)

        async def put(i: int) -> None:
            assert not await tier.put(_key(i), meta, payload)

        write_s = await _drive(count, put, order)
        start = time.perf_counter()
        await tier.flush()
        write_s += time.perf_counter() - start
        result = {"write_bytes_per_s": count * size / write_s, "objects": float(count),
                  "backend_io_uring": float(tier.stats()["backend"] == "io_uring")}
        if reads:
            async def get(i: int) -> None:
                assert await tier.get(_key(i)) is not None

            # random reads must not replay the write order, which is sequential on the log
            read_order = list(range(count))
            if random_order:
                random.Random(11).shuffle(read_order)
            read_s = await _drive(count, get, read_order)
            result["read_bytes_per_s"] = count * size / read_s
            result["read_iops"] = count / read_s
        return result
    finally:
        await tier.close()


# -- one file per object -------------------------------------------------------------------------
async def _files_run(directory: Path, size: int, count: int) -> dict[str, float]:
    os.makedirs(directory, exist_ok=True)
    payload = os.urandom(size)
    names = [directory / f"{i:08d}.blk" for i in range(count)]

    async def write(i: int) -> None:
        async with aiofiles.open(names[i], "wb") as f:
            await f.write(payload)

    order = list(range(count))
    write_s = await _drive(count, write, order)
    start = time.perf_counter()
    await asyncio.get_running_loop().run_in_executor(None, os.sync)
    write_s += time.perf_counter() - start
    for name in names:  # cold reads: drop each file's pages from the page cache
        fd = os.open(name, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    async def read(i: int) -> None:
        async with aiofiles.open(names[i], "rb") as f:
            data = await f.read()
        assert len(data) == size

    random.Random(9).shuffle(order)
    read_s = await _drive(count, read, order)
    shutil.rmtree(directory)
    return {"write_bytes_per_s": count * size / write_s, "read_bytes_per_s": count * size / read_s,
            "read_iops": count / read_s, "objects": float(count)}


# -- index memory --------------------------------------------------------------------------------
def index_bytes_per_entry(entries: int = INDEX_ENTRIES, *, traced: bool = True) -> float:
    """Bytes per entry of an `NvmeIndex` holding `entries` 33-byte keys.

    ``traced``: tracemalloc growth over building it (every allocation the index makes, keys
    included; ~40 s for 1 M entries, as tracemalloc slows each int allocation). Otherwise
    `NvmeIndex.memory_bytes()` (sys.getsizeof of its containers; a second).
    """
    from tierkv.tiers.nvme._index import NvmeIndex

    meta = _meta(4096)
    gc.collect()
    if traced:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = NvmeIndex(4096)
        for i in range(entries):
            key = b"\x01" + i.to_bytes(16, "little") + b"\x00" * 16
            index.put(key, region=i % 1000, offset=(i % 8000) * 8192, length=8192, meta=meta)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        if traced:
            tracemalloc.stop()
    assert len(index) == entries
    return (after - before if traced else index.memory_bytes()) / entries


# -- pairs ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Pair:
    """One tier figure beside the fio figure measured next to it (`fio_first`: fio ran first)."""

    tier: float
    fio: float
    fio_first: bool

    @property
    def ratio(self) -> float:
        return self.tier / self.fio


def _median_pair(pairs: Sequence[_Pair]) -> int:
    """Run-order index of the pair whose ratio is the median (the lower middle one if even)."""
    ranked = sorted(range(len(pairs)), key=lambda n: pairs[n].ratio)
    return ranked[(len(pairs) - 1) // 2]


def _pair_row(case: str, unit: str, pairs: Sequence[_Pair], target: float | None,
              baseline: str = _FIO_NAME) -> tuple[Row, dict[str, Any]]:
    """The row of the median pair (its tier and baseline figures), and the JSON of all the
    pairs (the baseline's figures under "fio", whatever it is: `baseline` names it)."""
    middle = pairs[_median_pair(pairs)]
    ratios = [pair.ratio for pair in pairs]
    low, high = min(ratios), max(ratios)
    row = Row(f"{case} (median of {len(pairs)} pairs, {low:.2f}\u2013{high:.2f})", unit,
              middle.tier, middle.fio, baseline, target)
    detail = {"case": case, "baseline": baseline, "pairs": len(pairs),
              "median_pair": _median_pair(pairs),
              "median_ratio": middle.ratio, "min_ratio": low, "max_ratio": high,
              "ratios": ratios, "tier": [pair.tier for pair in pairs],
              "fio": [pair.fio for pair in pairs],
              "fio_first": [pair.fio_first for pair in pairs]}
    return row, detail


@dataclass(frozen=True, slots=True)
class _Round:
    """One tier run (fill, then reads) with the fio jobs measured beside it."""

    tier: dict[str, float]
    fio_write: dict[str, float] | None
    fio_read: dict[str, float]
    #: whether fio ran before the tier's writes / before the tier's reads
    write_fio_first: bool
    read_fio_first: bool


async def _round(n: int, tier: Callable[[], Awaitable[dict[str, float]]],
                 fio_read: FioJob, fio_write: FioJob | None = None) -> _Round:
    """Round `n`: the fio jobs flank the tier run, each next to the tier phase it is set against.

    Even rounds run fio write, tier (write, read), fio read: fio first for writes, the tier first
    for reads. Odd rounds run the mirror image, so over the rounds each case alternates which
    side goes first and drift in the host's cache favours neither.
    """
    loop = asyncio.get_running_loop()
    first, last = (fio_write, fio_read) if n % 2 == 0 else (fio_read, fio_write)
    before = await loop.run_in_executor(None, first) if first is not None else None
    tier_result = await tier()
    after = await loop.run_in_executor(None, last) if last is not None else None
    write, read = (before, after) if n % 2 == 0 else (after, before)
    assert read is not None
    return _Round(tier_result, write, read, write_fio_first=n % 2 == 0,
                  read_fio_first=n % 2 == 1)


@dataclass(frozen=True, slots=True)
class _FilesPair:
    """A round and the one-file-per-object run made next to its tier run."""

    round: _Round
    files: dict[str, float]
    files_first: bool

    def bytes_pair(self, side: str) -> _Pair:
        """MB/s of the tier and of the files for `side` ("write" or "read")."""
        key = f"{side}_bytes_per_s"
        return _Pair(self.round.tier[key] / 1e6, self.files[key] / 1e6, self.files_first)


async def _with_files(n: int, round_run: Awaitable[_Round], directory: Path, size: int,
                      count: int) -> _FilesPair:
    """Round `n` and a one-file-per-object run of `count` objects in `directory`: after the
    round in even rounds, before it in odd ones, so neither side is always first."""
    if n % 2:
        files = await _files_run(directory, size, count)
        return _FilesPair(await round_run, files, files_first=True)
    done = await round_run
    return _FilesPair(done, await _files_run(directory, size, count), files_first=False)


# -- the run -------------------------------------------------------------------------------------
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


def _bytes_pair(r: _Round, side: str) -> _Pair:
    """The MB/s pair of round `r` for `side` ("write" or "read")."""
    if side == "write":
        assert r.fio_write is not None
        return _Pair(r.tier["write_bytes_per_s"] / 1e6, r.fio_write["bytes_per_s"] / 1e6,
                     r.write_fio_first)
    return _Pair(r.tier["read_bytes_per_s"] / 1e6, r.fio_read["bytes_per_s"] / 1e6,
                 r.read_fio_first)


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
