"""The NVMe bench's baselines: fio on the bench file (the device's own figure) and a directory
of one file per object written and read back with aiofiles.

Apart from the tier runs (`tierkv.bench.nvme_tier_runs`) because these measure no tierkv code:
they are what each tier run is set against, run at the tier's queue depth over the same bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import aiofiles

from tierkv.bench._fio import run_fio
from tierkv.bench.nvme_tier_runs import QUEUE_DEPTH, MiB, _drive

_FIO_NAME = "fio io_uring O_DIRECT"
#: one fio job, run in an executor thread; its figures ("bytes_per_s", "iops")
FioJob = Callable[[], dict[str, float]]


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
    out = run_fio(cmd)
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if "write" in rw else "read"]
    return {"bytes_per_s": float(side["bw_bytes"]), "iops": float(side["iops"])}


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
