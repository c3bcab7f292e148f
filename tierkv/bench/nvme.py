"""`tierkv bench --device nvme`: the NVMe tier beside fio and beside one-file-per-object aiofiles.

For each object size, in one invocation and on one file: fio (``--ioengine=io_uring --direct=1``,
same block size and queue depth) measures the device (the sequential 1 MiB write like the
tier's fill: the same bytes once, ending with an fsync, just before it), then the tier is
formatted on that same file and driven through the `NvmeTier` API by `QUEUE_DEPTH` asyncio
tasks, then a directory of
one file per object is written and read back with aiofiles (buffered IO, page cache dropped per
file with ``POSIX_FADV_DONTNEED`` after a sync, so its reads are cold). Index memory per entry is
measured over `NvmeIndex` holding 1 M entries of 33-byte keys (a `BlockKey`'s
canonical size): in full mode by tracemalloc over building it (every allocation the index makes,
keys included), in both modes by `NvmeIndex.memory_bytes()` (getsizeof of its containers; the
index has no per-entry Python objects, so the two agree; tracemalloc alone takes ~40 s).

`run_nvme_bench` returns JSON-able data: ``rows`` (`Row.to_json()` dicts), ``config`` (sizes,
durations, paths) and ``fio`` (raw fio figures). `nvme_rows(result)` turns ``rows`` back into
`Row` objects. Every bench file is deleted afterwards. Run the full bench with
``python -m tierkv.bench.nvme DIRECTORY`` (``--quick`` for the short one); add
``--seq-pairs N`` to run only `seq_write_pairs` (N fio/tier sequential-fill pairs).
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

from tierkv.bench.common import Progress, Row, no_progress
from tierkv.config import NvmeBackend, NvmeTierConfig
from tierkv.formats.value import ObjectMeta, ValueKind

QUEUE_DEPTH = 32
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
INDEX_ENTRIES = 1_000_000


@dataclass(frozen=True, slots=True)
class _Plan:
    file_size: int
    region_size: int
    fio_seconds: int
    files_cap: int


_QUICK = _Plan(file_size=256 * MiB, region_size=32 * MiB, fio_seconds=2, files_cap=2048)
_FULL = _Plan(file_size=3 * GiB // 2, region_size=64 * MiB, fio_seconds=8, files_cap=16384)


# -- fio -----------------------------------------------------------------------------------------
def _fio(path: Path, rw: str, bs: int, size: int, seconds: int) -> dict[str, float]:
    """fio for `seconds` over the first `size` bytes of `path` (no fsync)."""
    return _fio_job(path, rw, bs, [f"--size={size}", f"--runtime={seconds}", "--time_based"])


def _fio_fill(path: Path, nbytes: int) -> dict[str, float]:
    """fio writing `nbytes` once, sequentially in 1 MiB blocks, then fsync, like a tier fill.

    ``--end_fsync=1`` is counted in fio's runtime (as the tier's closing `flush()` is in its).
    """
    return _fio_job(path, "write", MiB, [f"--size={nbytes}", "--end_fsync=1"])


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
                          backend=NvmeBackend.AUTO, reinsert_hits=0, format=True)


def _fill_count(path: Path, size: int, plan: _Plan) -> int:
    """How many objects of `size` bytes a tier run puts: 85 % of the capacity."""
    from tierkv.tiers.nvme import NvmeTier

    tier = NvmeTier(_tier_config(path, plan))  # never opened: geometry only
    return int(tier.capacity * 0.85) // tier.footprint(size)


async def _tier_run(path: Path, size: int, plan: _Plan, *, random_order: bool,
                    reads: bool) -> dict[str, float]:
    from tierkv.tiers.nvme import NvmeTier

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
    from tierkv.tiers._nvme_index import NvmeIndex

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


# -- the run -------------------------------------------------------------------------------------
async def run_nvme_bench(directory: Path, *, quick: bool = False,
                         progress: Progress = no_progress) -> dict[str, Any]:
    """Run the benchmark under `directory` (see the module docstring for what and how)."""
    plan = _QUICK if quick else _FULL
    os.makedirs(directory, exist_ok=True)
    path = directory / "tierkv-bench.nvme"
    files_dir = directory / "tierkv-bench-files"
    rows: list[Row] = []
    fio: dict[str, dict[str, float]] = {}
    steps = 11
    done = 0

    def step(name: str) -> None:
        nonlocal done
        done += 1
        progress(name, done, steps)

    try:
        loop = asyncio.get_running_loop()
        for rw in ("randwrite", "read", "randread"):
            fio[f"{rw} 1MiB"] = await loop.run_in_executor(
                None, _fio, path, rw, MiB, plan.file_size, plan.fio_seconds)
            step(f"fio {rw} 1MiB")
        # like for like with the tier's fill just after it: same bytes, ends with an fsync
        fio["write 1MiB"] = await loop.run_in_executor(
            None, _fio_fill, path, _fill_count(path, MiB, plan) * MiB)
        step("fio write 1MiB")
        seq = await _tier_run(path, MiB, plan, random_order=False, reads=True)
        step("tier sequential 1MiB")
        rnd = await _tier_run(path, MiB, plan, random_order=True, reads=True)
        step("tier random 1MiB")
        target, name = 0.9, "fio io_uring O_DIRECT"
        rows += [
            Row("seq write 1MiB QD32", "MB/s", seq["write_bytes_per_s"] / 1e6,
                fio["write 1MiB"]["bytes_per_s"] / 1e6, name, target),
            Row("seq read 1MiB QD32", "MB/s", seq["read_bytes_per_s"] / 1e6,
                fio["read 1MiB"]["bytes_per_s"] / 1e6, name, target),
            Row("rand write 1MiB QD32", "MB/s", rnd["write_bytes_per_s"] / 1e6,
                fio["randwrite 1MiB"]["bytes_per_s"] / 1e6, name, target),
            Row("rand read 1MiB QD32", "MB/s", rnd["read_bytes_per_s"] / 1e6,
                fio["randread 1MiB"]["bytes_per_s"] / 1e6, name, target),
        ]
        tier_by_size = {MiB: rnd}
        for size, goal in ((64 * KiB, 0.6), (4 * KiB, None)):
            label = f"{size // KiB}KiB"
            fio[f"randread {label}"] = await loop.run_in_executor(
                None, _fio, path, "randread", size, plan.file_size, plan.fio_seconds)
            step(f"fio randread {label}")
            tier_by_size[size] = await _tier_run(path, size, plan, random_order=True, reads=True)
            step(f"tier random {label}")
            rows.append(Row(f"rand read {label} QD32", "IOPS", tier_by_size[size]["read_iops"],
                            fio[f"randread {label}"]["iops"], name, goal))
        path.unlink(missing_ok=True)
        for size, tier_result in tier_by_size.items():
            label = f"{size // KiB}KiB" if size < MiB else "1MiB"
            count = min(int(tier_result["objects"]), plan.files_cap)
            files = await _files_run(files_dir, size, count)
            rows += [
                Row(f"write {label}: tier vs file per object", "MB/s",
                    tier_result["write_bytes_per_s"] / 1e6, files["write_bytes_per_s"] / 1e6,
                    f"aiofiles, {count} files"),
                Row(f"rand read {label}: tier vs file per object", "MB/s",
                    tier_result["read_bytes_per_s"] / 1e6, files["read_bytes_per_s"] / 1e6,
                    f"aiofiles, {count} files, cold"),
            ]
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
        "rows": [row.to_json() for row in rows],
        "fio": fio,
        "config": {"quick": quick, "file_size": plan.file_size, "region_size": plan.region_size,
                   "queue_depth": QUEUE_DEPTH, "fio_seconds": plan.fio_seconds,
                   "directory": str(directory)},
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
    lines = [
        f"NVMe tier benchmark ({'quick' if config['quick'] else 'full'}): file "
        f"{config['file_size'] / GiB:.2f} GiB, region {config['region_size'] // MiB} MiB, "
        f"QD {config['queue_depth']}",
        f"{'case':<44} {'tier':>10} {'baseline':>10} {'ratio':>7} {'target':>7}  baseline",
    ]
    for row in nvme_rows(result):
        baseline = f"{row.baseline:10.1f}" if row.baseline is not None else f"{'-':>10}"
        ratio = f"{row.ratio:7.2f}" if row.ratio is not None else f"{'-':>7}"
        target = f"{row.target:7.2f}" if row.target is not None else f"{'-':>7}"
        mark = {True: " ok", False: " MISS", None: ""}[row.meets_target]
        lines.append(f"{row.case:<44} {row.measured:10.1f} {baseline} {ratio} {target}  "
                     f"{row.unit}, {row.baseline_name or 'no baseline'}{mark}")
    return lines


def _main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.nvme",
                                     description="The NVMe tier beside fio on one file.")
    parser.add_argument("directory", type=Path, help="where the bench file is made (and removed)")
    parser.add_argument("--quick", action="store_true", help="a smaller, shorter run")
    parser.add_argument("--seq-pairs", type=int, default=0, metavar="N",
                        help="only run N fio/tier sequential-fill pairs")
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
    result = asyncio.run(run_nvme_bench(directory, quick=quick))
    for line in render_nvme_report(result):
        print(line)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    _main(sys.argv[1:])
