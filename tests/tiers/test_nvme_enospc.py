"""A region write failing part way (a full file system) loses only what that write carried.

A flush writes the head's unwritten tail (write-behind), so the head holds entries that earlier
flushes made durable; a later write of the rest of that region failing must not take them along.
The writer process (this file run as a script) puts objects, deletes and overwrites some of them,
flushes every few operations and prints what each flush acknowledged, until a flush raises. It
then checks every acknowledged object in the live tier, and ends one of three ways: killed at
once (the next open scans), or the space comes back and a flush succeeds, then either a clean
close (the next open loads the checkpoint) or more operations that make the log wrap around
(every region reclaimed) and a kill. After reopening, every acknowledged object is there byte for
byte; a deleted one stays deleted; what the failed flush carried is either there or absent, and
after a later successful flush never an older value.

The write failures are real kernel errors: EFBIG from a lowered RLIMIT_FSIZE, the limit in the
middle of a region (the soft limit is raised again for "space came back"), and ENOSPC from an
ext4 file system on a 64 MiB loop device, onto which a valid, much larger log was copied sparsely
(a filler file is deleted for "space came back"). The loop mount needs root, `mkfs.ext4` and
loop devices; without them that test skips, saying which is missing.
"""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from tests.tiers._nvme_support import REGION, key, meta_of, nvme_config, payload_for
from tierkv.config import NvmeBackend, NvmeTierConfig
from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = [pytest.param(NvmeBackend.IO_URING, marks=pytest.mark.uring), NvmeBackend.THREADS]


@dataclass(frozen=True, slots=True)
class Scenario:
    """`regions` of `region_size` bytes, objects of `size` bytes, a flush every `every` steps
    (several flushes to a region, so that a failing write has flushed entries before it)."""

    regions: int
    region_size: int
    size: int
    every: int

    def config(self, directory: Path, backend: NvmeBackend) -> NvmeTierConfig:
        base = nvme_config(directory, regions=self.regions, backend=backend, reinsert_hits=0)
        return replace(base, region_size=self.region_size,
                       capacity=SUPERBLOCK_SIZE + self.regions * self.region_size)


#: EFBIG mid-region under RLIMIT_FSIZE; ENOSPC of a 256 MiB log on a 64 MiB file system
SCENARIOS = {"fsize": Scenario(8, REGION, 5000, 4), "enospc": Scenario(16, 16 << 20, 64 << 10, 16)}
#: how the writer ends after its failed flush (see the module docstring)
ENDS = ["kill", "close", "wrap"]


def value(i: int, version: int, size: int) -> bytes:
    return payload_for(i * 100 + version, size)


def key_id(raw: bytes) -> int:
    return int(raw.rsplit(b"-", 1)[1])


# -- the writer process ----------------------------------------------------------------------------
class Writer:
    """Runs the operations, prints them (``OP P<i>.<version>`` / ``OP D<i>``) before each, the
    keys the tier drops (``DROP``) as it drops them, and ``ACK`` after each flush that returned."""

    def __init__(self, tier: NvmeTier, size: int, every: int) -> None:
        self.tier, self.size, self.every = tier, size, every
        self.version: dict[int, int] = {}  # what the tier holds now; 0: deleted or dropped
        self.acked: dict[int, int] = {}
        self.batch: list[tuple[int, int]] = []
        self.n = 0
        tier.set_drop_listener(self._dropped)

    def _dropped(self, keys: Sequence[bytes], _for_room: bool) -> None:
        ids = [key_id(k) for k in keys]
        for i in ids:
            self.version[i] = 0
        print("DROP", *ids, flush=True)

    async def put(self, i: int, version: int) -> None:
        print(f"OP P{i}.{version}", flush=True)
        data = value(i, version, self.size)
        await self.tier.put(key(i), meta_of(data), memoryview(data))
        self.version[i] = version
        self.batch.append((i, version))

    async def delete(self, i: int) -> None:
        print(f"OP D{i}", flush=True)
        if await self.tier.delete(key(i)):
            self.version[i] = 0
            self.batch.append((i, 0))

    async def step(self) -> None:
        """One put of a new key, now and then a delete or an overwrite of an older one (some
        in the head, some in older regions); a flush every `every` steps (raising through)."""
        n = self.n
        self.n += 1
        await self.put(n, 1)
        for due, i, overwrite in ((n % 10 == 9, n - 6, False), (n % 10 == 4, n - 8, True),
                                  (n % 25 == 12, n - 150, False), (n % 25 == 20, n - 170, True)):
            if due and i >= 0 and self.version.get(i, 0):
                await (self.put(i, self.version[i] + 1) if overwrite else self.delete(i))
        if n % self.every == self.every - 1:
            await self.tier.flush()
            self.acked.update(self.batch)
            self.batch = []
            print("ACK", flush=True)

    async def check_live(self) -> None:
        """Every acknowledged object is served as acknowledged; what the failed flush carried is
        either what it wrote or gone, never an older value."""
        touched = {i for i, _v in self.batch}
        for i, version in sorted(self.acked.items()):
            got = await self.tier.get(key(i))
            found = None if got is None else payload_bytes(got[1])
            if i in touched:
                ok = found is None or found == value(i, self.version[i], self.size)
            else:
                ok = found == (value(i, version, self.size) if version else None)
            if not ok:
                print("LIVE_BAD", i, flush=True)
        print("LIVE_DONE", flush=True)


async def write(mode: str, directory: Path, name: str, backend: NvmeBackend, *, end: str,
                lift: Callable[[], None]) -> None:
    scenario = SCENARIOS[mode]
    every = scenario.every
    tier = NvmeTier(replace(scenario.config(directory, backend), path=directory / name))
    await tier.open()
    writer = Writer(tier, scenario.size, every)
    try:
        while writer.n < 100_000:
            await writer.step()
        print("NO_ERROR", flush=True)
        return
    except DeviceError as exc:
        print("FAILED", exc.errno, flush=True)
    await writer.check_live()
    if end != "kill":
        lift()
        while writer.n % every:  # finish the batch in progress: this flush must succeed
            await writer.step()
        await tier.flush()
        print("ACK", flush=True)
        if end == "close":
            await tier.close()
            print("CLOSED", flush=True)
            return
        # wraps around the log: every region reclaimed, the one that failed among them
        target = writer.n + 3 * scenario.regions * (scenario.region_size // scenario.size)
        while writer.n < target:
            await writer.step()
    print("READY", flush=True)
    await asyncio.sleep(3600)


def writer_main(argv: list[str]) -> None:
    mode, directory, name, backend, end, extra = argv
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG

    def lift() -> None:
        if mode == "fsize":
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        else:
            os.unlink(extra)
            os.sync()

    if mode == "fsize":
        # the soft limit only: raising it back is "the space came back"
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(extra), resource.RLIM_INFINITY))
    asyncio.run(write(mode, Path(directory), name, NvmeBackend(backend), end=end, lift=lift))


# -- the tests -------------------------------------------------------------------------------------
@dataclass
class Model:
    """What each key may hold after reopening (versions; 0: absent), from the writer's lines."""

    allowed: dict[int, set[int]] = field(default_factory=dict)
    pending: list[tuple[str, int, int]] = field(default_factory=list)
    failed_errno: int | None = None
    failure_drops: set[int] = field(default_factory=set)
    failed_batch: set[int] = field(default_factory=set)
    live_bad: list[int] = field(default_factory=list)

    def feed(self, words: list[str], *, end: str) -> None:
        what = words[0]
        if what == "OP":
            token = words[1]
            ident, _, number = token[1:].partition(".")
            self.pending.append(("P" if token[0] == "P" else "D", int(ident), int(number or 0)))
        elif what == "DROP":
            if self.failed_errno is None:  # no reclaim before the failure: the failed write's
                self.failure_drops.update(int(w) for w in words[1:])
            self.pending.extend(("X", int(w), 0) for w in words[1:])
        elif what == "ACK":
            for op, i, version in self.pending:
                if op == "X":  # a reclaim let go of it: gone, or (until overwritten) back
                    self.allowed[i] = self.allowed.get(i, {0}) | {0}
                else:
                    self.allowed[i] = {version}
            self.pending = []
        elif what == "FAILED":
            self.failed_errno = int(words[1])
            for op, i, version in self.pending:
                if op == "X":
                    continue
                self.failed_batch.add(i)
                # killed at once, the failed flush may have left either state; once a flush
                # succeeded, what the failed writes carried is there or gone, never older
                before = self.allowed.get(i, {0}) if end == "kill" else set()
                self.allowed[i] = before | {0, version}
            self.pending = []
        elif what == "LIVE_BAD":
            self.live_bad.append(int(words[1]))


def run_writer(args: list[str], end: str) -> Model:
    """Run the writer to its end (killing it where it waits) and parse what it printed."""
    proc = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )
    model = Model()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            words = raw.decode().split()
            lines.append(" ".join(words[:3]))
            if not words:
                continue
            if words[0] == "READY":
                proc.send_signal(signal.SIGKILL)
                break
            model.feed(words, end=end)
    finally:
        if proc.poll() is None and end != "close":
            proc.send_signal(signal.SIGKILL)
        _out, err = proc.communicate(timeout=120)
    expected = 0 if end == "close" else -signal.SIGKILL
    assert proc.returncode == expected, err.decode()[-3000:]
    assert model.failed_errno is not None, lines[-5:]
    return model


async def check_reopened(directory: Path, backend: NvmeBackend, mode: str, model: Model, *,
                         recovered_from: str) -> None:
    scenario = SCENARIOS[mode]
    size = scenario.size
    tier = NvmeTier(scenario.config(directory, backend))
    recovered = await tier.open()
    try:
        assert tier.stats()["recovered_from"] == recovered_from
        found: dict[int, int] = {}
        for r in recovered:
            i = key_id(r.key)
            got = await tier.get(r.key)
            assert got is not None, i
            data = payload_bytes(got[1])
            versions = [v for v in model.allowed.get(i, {0}) if v and value(i, v, size) == data]
            assert versions, f"key {i} holds a value it may not hold ({model.allowed.get(i)})"
            found[i] = versions[0]
        missing = sorted(i for i, allowed in model.allowed.items()
                         if 0 not in allowed and i not in found)
        assert not missing, f"{len(missing)} acknowledged objects are gone: {missing[:20]}"
    finally:
        await tier.close()


@pytest.mark.crash
@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("backend", BACKENDS, ids=["uring", "threads"])
async def test_efbig_mid_region_keeps_every_flushed_object(
    tmp_path: Path, backend: NvmeBackend, end: str
) -> None:
    setup = NvmeTier(SCENARIOS["fsize"].config(tmp_path, backend))
    await setup.open()  # formats the file at its full size before the limit applies
    await setup.close()
    # writes fail from 300 KiB into the third region: the head then holds ~37 flushed batches
    limit = SUPERBLOCK_SIZE + 2 * REGION + 300 * 1024
    model = run_writer(["fsize", str(tmp_path), "tier.log", backend.value, end, str(limit)], end)
    assert model.failed_errno == errno.EFBIG
    assert not model.live_bad, f"acknowledged objects lost in the live tier: {model.live_bad}"
    assert model.failure_drops <= model.failed_batch
    await check_reopened(tmp_path, backend, "fsize", model,
                         recovered_from="checkpoint" if end == "close" else "scan")


def sparse_copy(source: Path, target: Path, block: int = 1 << 20) -> None:
    """Copy `source` leaving holes where it holds zeros (what ``cp --sparse=always`` does)."""
    with source.open("rb") as src, target.open("wb") as dst:
        while data := src.read(block):
            if any(data):
                dst.write(data)
            else:
                dst.seek(len(data), os.SEEK_CUR)
        dst.truncate()


def _loop_mount_missing() -> str | None:
    if os.geteuid() != 0:
        return "mounting a loop-device ext4 file system needs root"
    for tool in ("mkfs.ext4", "mount", "umount", "losetup"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/dev/loop-control").exists():
        return "no loop devices (/dev/loop-control is absent)"
    return None


@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB ext4 file system on a loop device, mounted; unmounted (and detached) after."""
    if reason := _loop_mount_missing():
        pytest.skip(reason)
    image, mount = tmp_path / "ext4.img", tmp_path / "mnt"
    mount.mkdir()
    with image.open("wb") as f:
        f.truncate(64 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)],
                          capture_output=True, check=False)
    if made.returncode:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.decode().strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount)],
                             capture_output=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot loop-mount an ext4 image: {mounted.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, check=False)


@pytest.mark.crash
@pytest.mark.direct
@pytest.mark.parametrize("end", ["kill", "close"])
@pytest.mark.parametrize("backend", BACKENDS, ids=["uring", "threads"])
async def test_enospc_on_full_ext4_keeps_every_flushed_object(
    tmp_path: Path, small_ext4: Path, backend: NvmeBackend, end: str
) -> None:
    setup = NvmeTier(SCENARIOS["enospc"].config(tmp_path, backend))
    await setup.open()
    await setup.close()
    # a valid 256 MiB log on a 64 MiB file system: its writes allocate until the space runs out
    sparse_copy(tmp_path / "tier.log", small_ext4 / "tier.log")
    filler = small_ext4 / "filler"
    filler.write_bytes(os.urandom(8 << 20))  # deleted when the space is to come back
    os.sync()
    model = run_writer(["enospc", str(small_ext4), "tier.log", backend.value, end, str(filler)],
                       end)
    assert model.failed_errno == errno.ENOSPC
    assert not model.live_bad, f"acknowledged objects lost in the live tier: {model.live_bad}"
    assert model.failure_drops <= model.failed_batch
    await check_reopened(small_ext4, backend, "enospc", model,
                         recovered_from="checkpoint" if end == "close" else "scan")


if __name__ == "__main__":
    writer_main(sys.argv[1:])
