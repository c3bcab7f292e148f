"""The NVMe bench's tier side: the plan of a run, the tier filled and read back through the
`NvmeTier` API by `QUEUE_DEPTH` tasks, and the index's memory per entry.

Apart from the baselines (`tierkv.bench.nvme_baselines`) and from the pairing of the two
(`tierkv.bench.nvme_pairs`) because this is what the bench measures of tierkv itself; the
queue depth and the plan are defined here and the baselines run at the same depth.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierkv.config import NvmeBackend, NvmeTierConfig
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
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
    pairs: int
    #: the tier's `sq_poll` (io_uring submission-queue polling); None: off, the default
    sq_poll: float | None = None


_QUICK = _Plan(file_size=256 * MiB, region_size=32 * MiB, fio_seconds=1, files_cap=2048, pairs=3)
_FULL = _Plan(file_size=3 * GiB // 2, region_size=64 * MiB, fio_seconds=4, files_cap=16384,
              pairs=5)


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


def _forget_log(path: Path) -> None:
    """Zero the superblock of the log at `path` (the bench's scratch file), if any, so that
    the next tier run starts on an empty log over the extents already written (as fio's runs
    beside it do). `format = true` keeps a valid log of the same geometry: a run after another
    with only a fio read between recovered the keys it then put again, and its reclaims
    dropped live entries."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fchmod(fd, 0o600)  # fio made it 0644: the tier would warn at each open
        os.pwrite(fd, bytes(SUPERBLOCK_SIZE), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


async def _tier_run(path: Path, size: int, plan: _Plan, *, random_order: bool,
                    reads: bool) -> dict[str, float]:
    from tierkv.tiers.nvme.tier import NvmeTier

    _forget_log(path)
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
