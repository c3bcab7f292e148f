"""Cancellation safety of the NVMe tier, and its drop reports.

Rounds of concurrent puts, deletes, gets and flushes (each on its own key: the owner orders the
operations on one key) are cancelled at random moments, half by `Task.cancel` after a random
delay and half by `asyncio.wait_for` with a tiny limit. After each round a plain put must finish
within `LIMIT` (a tier left with an orphaned head, a lost seal slot or a cancelled region write
hangs there). At the end the tier is flushed, closed and reopened, and every key must hold what
the operations that returned left it, byte for byte; where an operation was cancelled, whatever
the contract allows it to leave (`tierkv.tiers.base`: the old object, the new one, or none).
Keys the tier drops on its own are learnt from its drop listener, the moment they are dropped,
which is what lets a cancelled put's drops (never returned) be known at all.

The drop listener itself: a put that reclaims a region reports the victim's keys before it
returns; a delete that reclaims one reports them before it returns too; a get that finds its
entry damaged on media reports the key it lets go of; a failed region write reports the region's
keys in the step that drops them (a real EFBIG under a lowered RLIMIT_FSIZE, as in
`test_nvme_faults`, in a subprocess: this file run as a script).
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.tiers._nvme_support import (
    REGION,
    find_unique,
    flip_byte,
    key,
    meta_of,
    nvme_config,
    payload_for,
    per_region,
)
from tierkv.config import NvmeBackend
from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.io._aligned import AlignedBuffer
from tierkv.tiers.nvme.io._threads import ThreadIO
from tierkv.tiers.nvme.tier import NvmeTier

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = [pytest.param(NvmeBackend.IO_URING, marks=pytest.mark.uring), NvmeBackend.THREADS]
#: seconds a plain operation may take before the tier counts as hung
LIMIT = 10.0
#: what a key holds when it holds nothing
ABSENT = None


@pytest.fixture(params=BACKENDS, ids=["uring", "threads"])
def backend(request: pytest.FixtureRequest) -> NvmeBackend:
    value: NvmeBackend = request.param
    return value


@dataclass
class Expected:
    """What each key may hold now (payloads or `ABSENT`), from the operations seen so far."""

    may: dict[bytes, set[bytes | None]] = field(default_factory=dict)
    #: the outcome of the operation in flight on a key (one at a time per key)
    pending: dict[bytes, bytes | None] = field(default_factory=dict)
    dropped: set[bytes] = field(default_factory=set)

    def allows(self, k: bytes) -> set[bytes | None]:
        return self.may.get(k, {ABSENT})

    def start(self, k: bytes, outcome: bytes | None) -> None:
        """An operation that may leave `outcome` begins: until it returns, either state."""
        self.pending[k] = outcome
        self.may[k] = self.allows(k) | {outcome}

    def end(self, k: bytes, *, returned: bool) -> None:
        outcome = self.pending.pop(k)
        if returned:
            self.may[k] = {outcome}

    def on_drop(self, keys: Sequence[bytes], _for_room: bool) -> None:
        """The drop listener: gone now, unless the operation in flight stores it again."""
        for k in keys:
            self.dropped.add(k)
            self.may[k] = {ABSENT, self.pending[k]} if k in self.pending else {ABSENT}


@dataclass(frozen=True)
class Workload:
    regions: int
    size: int  # payload bytes of a put
    keys: int  # distinct keys the rounds draw from
    rounds: int
    width: int  # operations started per round
    flush_every: int  # rounds between plain flushes


def _describe(value: bytes | None) -> str:
    return "nothing" if value is None else f"another value ({value[:18]!r}...)"


async def _cancel_after(task: asyncio.Task[None], delay: float) -> None:
    await asyncio.sleep(delay)
    task.cancel()


class Driver:
    """Runs cancelled operations against one tier and keeps `Expected` up to date."""

    def __init__(self, tier: NvmeTier, rng: random.Random, work: Workload) -> None:
        self.tier = tier
        self.rng = rng
        self.work = work
        self.expected = Expected()
        self.version = 0
        tier.set_drop_listener(self.expected.on_drop)

    def _data(self, i: int) -> bytes:
        self.version += 1
        return payload_for(i * 100000 + self.version, self.work.size)

    def _work(self, op: str, i: int, data: bytes | None) -> Awaitable[Any]:
        k, tier = key(i), self.tier
        if op == "put":
            assert data is not None
            return tier.put(k, meta_of(data), memoryview(data))
        if op == "delete":
            return tier.delete(k)
        if op == "get":
            return tier.get(k)
        return tier.flush()

    async def _op(self, op: str, i: int, limit: float | None) -> None:
        """One operation, cancelled by `wait_for` after `limit` (or by `Task.cancel`)."""
        k = key(i)
        data = self._data(i) if op == "put" else None
        before = self.expected.allows(k)
        if op in ("put", "delete"):
            self.expected.start(k, data)
        work = self._work(op, i, data)
        returned = False
        try:
            result = await (work if limit is None else asyncio.wait_for(work, limit))
            returned = True
        except (asyncio.CancelledError, TimeoutError):
            pass
        finally:
            if op in ("put", "delete"):
                self.expected.end(k, returned=returned)
        if returned and op == "get":
            got = None if result is None else payload_bytes(result[1])
            # a get overlapping a drop may return the whole object or nothing
            allowed = got in before | self.expected.allows(k)
            assert allowed, f"get of key {i} returned {_describe(got)}"
        if returned and op == "put":
            # what a put returns it dropped was reported to the listener already
            assert set(result) <= self.expected.dropped

    async def round(self) -> None:
        rng, work = self.rng, self.work
        tasks = []
        for i in rng.sample(range(work.keys), work.width):
            roll = rng.random()
            op = ("put" if roll < 0.7 else "delete" if roll < 0.8
                  else "get" if roll < 0.9 else "flush")
            how = rng.random()
            limit = rng.uniform(0, 0.003) if how < 0.25 else None
            task = asyncio.create_task(self._op(op, i, limit))
            if 0.25 <= how < 0.5:
                tasks.append(asyncio.create_task(_cancel_after(task, rng.uniform(0, 0.003))))
            tasks.append(task)
        await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled():
                task.result()  # a failed check or an unexpected error fails the test

    async def plain_put(self, i: int) -> None:
        """A put nobody cancels; it must return within `LIMIT` (hang detection)."""
        k, data = key(i), self._data(i)
        self.expected.start(k, data)
        try:
            await asyncio.wait_for(self.tier.put(k, meta_of(data), memoryview(data)), LIMIT)
        except TimeoutError:
            pytest.fail(f"a plain put did not return within {LIMIT}s: the tier hangs")
        self.expected.end(k, returned=True)

    async def run(self) -> None:
        work = self.work
        for n in range(work.rounds):
            await self.round()
            await self.plain_put(work.keys + n)
            if n % work.flush_every == work.flush_every - 1:
                await asyncio.wait_for(self.tier.flush(), LIMIT)


async def _check_reopened(tmp_path: Path, backend: NvmeBackend, work: Workload,
                          expected: Expected) -> int:
    """Reopen and compare every key with what it may hold; returns how many keys hold data."""
    tier = NvmeTier(nvme_config(tmp_path, regions=work.regions, backend=backend))
    await tier.open()
    try:
        # a full log too keeps regions free for its checkpoint, which close wrote
        assert tier.stats()["recovered_from"] == "checkpoint"
        present = 0
        for k, allowed in expected.may.items():
            got = await tier.get(k)
            value = None if got is None else payload_bytes(got[1])
            assert value in allowed, f"{k!r} holds {_describe(value)}"
            present += value is not None
        assert set(tier.keys()) <= set(expected.may)
        assert tier.stats()["checksum_failures"] == 0
    finally:
        await tier.close()
    return present


async def _exercise(tmp_path: Path, backend: NvmeBackend, work: Workload, seed: int) -> Driver:
    tier = NvmeTier(nvme_config(tmp_path, regions=work.regions, backend=backend))
    await tier.open()
    driver = Driver(tier, random.Random(seed), work)
    await driver.run()
    await asyncio.wait_for(tier.flush(), LIMIT)
    assert tier.stats()["checksum_failures"] == 0
    await asyncio.wait_for(tier.close(), LIMIT)
    present = await _check_reopened(tmp_path, backend, work, driver.expected)
    certain = [k for k, allowed in driver.expected.may.items() if len(allowed) == 1]
    assert present >= work.keys // 4 and len(certain) >= work.keys // 4  # the test tested
    return driver


async def test_cancelled_puts_keep_flushed_data(tmp_path: Path, backend: NvmeBackend) -> None:
    """12 concurrent 300 KiB puts, half cancelled; room for everything (nothing reclaimed)."""
    work = Workload(regions=72, size=300 << 10, keys=40, rounds=20, width=12, flush_every=3)
    driver = await _exercise(tmp_path, backend, work, seed=11)
    assert not driver.expected.dropped


async def test_cancelled_operations_never_hang(tmp_path: Path, backend: NvmeBackend) -> None:
    """One 700 kB entry a region, few regions: every put rotates and most reclaim."""
    work = Workload(regions=12, size=700_000, keys=24, rounds=60, width=7, flush_every=4)
    driver = await _exercise(tmp_path, backend, work, seed=5)
    assert driver.expected.dropped  # reclaims happened


async def test_cancelled_thread_read_returns_after_its_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker thread cannot be stopped: a cancelled read must not hand its buffer back (to the
    tier's pool, for another read) while the worker still reads into it. The read syscall is
    made slow by wrapping `os.preadv`; the cancellation is real."""
    path = tmp_path / "data"
    data = os.urandom(8192)
    path.write_bytes(data)
    entered, proceed = threading.Event(), threading.Event()
    preadv = os.preadv

    def slow_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        entered.set()
        proceed.wait(LIMIT)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    fd = os.open(path, os.O_RDONLY)
    io = ThreadIO(fd, str(path), 4)
    buf = AlignedBuffer(len(data))
    try:
        read = asyncio.create_task(io.read(buf, 0, len(data)))
        await asyncio.to_thread(entered.wait, LIMIT)
        read.cancel()
        await asyncio.sleep(0.05)
        assert not read.done()  # its worker still holds the buffer
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await read
        assert bytes(buf.view[: len(data)]) == data  # the worker was done when it returned
    finally:
        proceed.set()
        await io.aclose()
        buf.close()
        os.close(fd)


# -- the drop listener ---------------------------------------------------------------------------
class DropLog:
    """Each report with the operation in flight and whether any reported key was still held."""

    def __init__(self, tier: NvmeTier) -> None:
        self.tier = tier
        self.during: str | None = None
        self.reports: list[tuple[str | None, frozenset[bytes], bool]] = []
        #: whether each report was of keys dropped for room (a reclaim)
        self.for_room: list[bool] = []
        tier.set_drop_listener(self)

    def __call__(self, keys: Sequence[bytes], for_room: bool) -> None:
        held = set(self.tier.keys())
        self.reports.append((self.during, frozenset(keys), any(k in held for k in keys)))
        self.for_room.append(for_room)


async def test_reclaiming_put_reports_victim_before_returning(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=3, reinsert_hits=0))
    await tier.open()
    drops = DropLog(tier)
    try:
        for i in range(600):
            data = payload_for(i, 8000)
            drops.during = f"put {i}"
            returned = await tier.put(key(i), meta_of(data), memoryview(data))
            drops.during = None
            if returned:
                break
        else:
            pytest.fail("no put reclaimed a region")
        during, reported, still_held = drops.reports[-1]
        assert during == f"put {i}"
        assert reported == set(returned) and key(0) in reported
        assert not still_held
        assert [r[0] for r in drops.reports] == [during]  # reported once, by that put
        assert drops.for_room == [True]
    finally:
        await tier.close()


async def test_reclaiming_delete_reports_victim_before_returning(tmp_path: Path) -> None:
    # four regions, one kept free for the checkpoint: three for data
    tier = NvmeTier(nvme_config(tmp_path, regions=4, reinsert_hits=0))
    await tier.open()
    drops = DropLog(tier)
    try:
        # three regions nearly full, nothing dropped; small entries, so that the tombstones
        # filling the head delete little of the log: still over half live, it reclaims the
        # oldest region (a mostly free log reclaims its emptiest, `_keep.choose_victim`)
        count = 3 * per_region(1000) - 4
        for i in range(count):
            data = payload_for(i, 1000)
            assert not await tier.put(key(i), meta_of(data), memoryview(data))
        for i in range(count - 1, 0, -1):  # tombstones fill the head until one reclaims region 0
            drops.during = f"delete {i}"
            assert await tier.delete(key(i))
            drops.during = None
            if drops.reports:
                break
        during, reported, still_held = drops.reports[0]
        assert during == f"delete {i}" and key(0) in reported and not still_held
        assert drops.for_room[0]
        data = payload_for(10_000, 8000)
        # keys dropped inside a delete are returned by the next put, as before the listener
        assert set(await tier.put(key(10_000), meta_of(data), memoryview(data))) >= reported
    finally:
        await tier.close()


async def test_get_failing_its_checksum_reports_the_key(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path))
    await tier.open()
    for i in range(300):
        await tier.put(key(i), meta_of(payload_for(i, 3000)), memoryview(payload_for(i, 3000)))
    await tier.close()  # a checkpoint: the damage is found at `get`, not at open
    flip_byte(tmp_path / "tier.log", find_unique(tmp_path / "tier.log", payload_for(7, 3000)) + 9)
    again = NvmeTier(nvme_config(tmp_path))
    await again.open()
    drops = DropLog(again)
    try:
        drops.during = "get 7"
        assert await again.get(key(7)) is None
        assert drops.reports == [("get 7", frozenset({key(7)}), False)]
        assert drops.for_room == [False]  # its copy failed: not an eviction
        assert again.stats()["checksum_failures"] == 1
    finally:
        await again.close()


#: entries of 5000 payload bytes a region holds: the first one in region 1
FIRST = per_region(5000)


def _ids(keys: Sequence[bytes]) -> str:
    return ",".join(str(int(k.rsplit(b"-", 1)[1])) for k in sorted(keys))


@pytest.mark.parametrize("case", ["head", "sealed"])
@pytest.mark.parametrize("backend", BACKENDS, ids=["uring", "threads"])
def test_failed_region_write_reports_its_keys(tmp_path: Path, backend: NvmeBackend,
                                              case: str) -> None:
    async def format_file() -> None:
        setup = NvmeTier(nvme_config(tmp_path, backend=backend))
        await setup.open()  # formats the file at its full size before the limit applies
        await setup.close()

    asyncio.run(format_file())
    result = subprocess.run(
        [sys.executable, __file__, case, str(tmp_path), backend.value],
        capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
        timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stdout.decode().splitlines()
    reports = [line.split() for line in lines if line.startswith("DROPPED")]
    assert reports, lines
    _word, ids, during, still_held = reports[0]
    # region 1 (the second) is beyond the limit; it holds the entries from `FIRST` on
    if case == "head":
        assert during == "flush" and ids == _ids([key(i) for i in range(FIRST, FIRST + 10)])
        assert f"FLUSH_FAILED {errno.EFBIG}" in lines
        assert f"RETURNED {ids}" in lines
    else:
        # the first sealed region beyond the limit, or (a loaded machine: the puts ran on into
        # region 2 before region 1's failed write ended, and the two writes end in any order)
        # the next one: each region's report names its own entries, whole
        regions = [_ids([key(i) for i in range(r * FIRST, (r + 1) * FIRST)]) for r in (1, 2)]
        assert during.startswith("put") and ids in regions, (ids, regions)
    assert still_held == "0"


async def _failing_writer(directory: Path, backend: NvmeBackend, case: str) -> None:
    """Writes to region 1 and beyond fail with EFBIG; prints each drop report as
    ``DROPPED ids during still-held`` (ids comma-separated)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = SUPERBLOCK_SIZE + REGION
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    tier = NvmeTier(nvme_config(directory, backend=backend, reinsert_hits=0))
    await tier.open()
    drops = DropLog(tier)
    printed = 0

    def show() -> None:
        nonlocal printed
        for during, keys, held in drops.reports[printed:]:
            print("DROPPED", _ids(list(keys)), (during or "idle").replace(" ", ""), int(held),
                  flush=True)
        printed = len(drops.reports)

    # region 0 takes entries 0 to FIRST - 1 (5000-byte payloads, packed)
    count = FIRST + 10 if case == "head" else 4 * FIRST - 8
    for i in range(count):
        data = payload_for(i, 5000)
        drops.during = f"put {i}"
        await tier.put(key(i), meta_of(data), memoryview(data))
        drops.during = None
        if drops.reports:
            break
    # the sealed region's write fails in the background: on a loaded machine it may end only
    # after the last put, so wait for its report (at most 10 s) rather than race it
    for _ in range(1000):
        if drops.reports or case == "head":
            break
        await asyncio.sleep(0.01)
    show()
    if case == "head":
        drops.during = "flush"
        try:
            await tier.flush()
        except DeviceError as exc:
            drops.during = None
            show()
            print("FLUSH_FAILED", exc.errno, flush=True)
        data = payload_for(9999, 100)
        returned = await tier.put(key(9999), meta_of(data), memoryview(data))
        print("RETURNED", _ids(returned), flush=True)
    await tier.close()


if __name__ == "__main__":
    asyncio.run(_failing_writer(Path(sys.argv[2]), NvmeBackend(sys.argv[3]), sys.argv[1]))
