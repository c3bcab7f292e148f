"""Bit flips in a closed pool never take down the process that opens it.

A pool of `OBJECTS` records is written once; each case copies it, flips real bits in the copy
and opens it in a forked child (a "zygote" subprocess imports tierkv once and forks one child per
open, so that an open that crashes kills only that child). The child opens the tier, reads every
key back and reports; the test asserts that it was never killed by a signal and that it either
opened, serving every object byte for byte or as a counted miss (freed as corrupt at open, or a
checksum miss at get), or refused the pool with a `DeviceError` naming the path.

Before the open probe (`tierkv.tiers.pmem._probe`) 5 of the 12 default seeds killed the child
inside ``pmemobj_open`` (SIGSEGV, once SIGFPE), most from a flipped ``next`` offset of a lane's
undo or redo log. ``TIERKV_PMEM_DAMAGE_SEEDS`` runs more seeds than the default 12.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierkv.config import PmemTierConfig
from tierkv.errors import DeviceError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.pmem import _probe
from tierkv.tiers.pmem.tier import PmemTier

pytestmark = pytest.mark.pmem

OBJECTS = 200
SIZE = 70_000
CAPACITY = 16 << 20
FLIPS = 64
SPAN = 2 << 20  # the pool header, the descriptor and the first two thirds of the lanes
SEEDS = int(os.environ.get("TIERKV_PMEM_DAMAGE_SEEDS", "12"))

ZYGOTE = textwrap.dedent("""
    import asyncio, json, os, random, sys
    from pathlib import Path
    from tierkv.config import PmemTierConfig
    from tierkv.errors import DeviceError
    from tierkv.tiers.pmem.tier import PmemTier

    async def check(path, fmt, objects, size, capacity):
        tier = PmemTier(PmemTierConfig("pmem", capacity, Path(path), format=fmt))
        try:
            recovered = await tier.open()
        except DeviceError as exc:
            return {"outcome": "DeviceError", "message": str(exc)}
        try:
            served = wrong = missed = 0
            for index in range(objects):
                got = await tier.get(f"k{index}".encode())
                if got is None:
                    missed += 1
                elif bytes(got[1]) == random.Random(index).randbytes(size):
                    served += 1
                else:
                    wrong += 1
            stats = tier.stats()
            return {"outcome": "opened", "recovered": len(recovered), "served": served,
                    "wrong": wrong, "missed": missed,
                    "corrupt_freed": stats["corrupt_freed_at_open"],
                    "checksum_misses": stats["checksum_misses"]}
        finally:
            await tier.close()

    for line in sys.stdin:
        path, fmt, objects, size, capacity = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                try:
                    result = asyncio.run(check(path, fmt == "1", int(objects), int(size),
                                               int(capacity)))
                except BaseException as exc:
                    result = {"outcome": type(exc).__name__, "message": str(exc)}
                print("result", json.dumps(result), flush=True)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("status", status, flush=True)
""")


def payload(index: int) -> bytes:
    return random.Random(index).randbytes(SIZE)


async def write_pool(path: Path) -> None:
    tier = PmemTier(PmemTierConfig("pmem", CAPACITY, path))
    await tier.open()
    try:
        for index in range(OBJECTS):
            meta = ObjectMeta(ValueKind.BYTES, "", (), SIZE, 1)
            await tier.put(f"k{index}".encode(), meta, payload(index))
    finally:
        await tier.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("damage") / "pristine.pool"
    asyncio.run(write_pool(path))
    return path


class Opener:
    """Opens a pool in a forked child of the zygote; the child's wait status and report."""

    def __init__(self, zygote: subprocess.Popen[str]) -> None:
        assert zygote.stdin is not None and zygote.stdout is not None
        self._stdin = zygote.stdin
        self._stdout = zygote.stdout

    def open(self, path: Path, *, fmt: bool = False) -> tuple[int, dict[str, Any] | None]:
        self._stdin.write(f"{path} {int(fmt)} {OBJECTS} {SIZE} {CAPACITY}\n")
        self._stdin.flush()
        report = None
        while True:
            kind, _, rest = self._stdout.readline().partition(" ")
            if kind == "result":
                report = json.loads(rest)
            elif kind == "status":
                return int(rest), report
            else:
                raise AssertionError(f"the zygote said {kind!r} {rest!r}")


@pytest.fixture(scope="module")
def opener() -> Iterator[Opener]:
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield Opener(proc)
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


def damaged_copy(pristine: Path, path: Path, bits: list[int]) -> Path:
    """A copy of `pristine` at `path` with each of `bits` (bit offsets in the file) flipped."""
    shutil.copyfile(pristine, path)
    with path.open("r+b") as f:
        for bit in bits:
            f.seek(bit // 8)
            byte = f.read(1)[0] ^ (1 << (bit % 8))
            f.seek(bit // 8)
            f.write(bytes([byte]))
    return path


def assert_survived(path: Path, status: int, report: dict[str, Any] | None) -> dict[str, Any]:
    """The child ended normally, and either opened the pool or refused it naming `path`."""
    assert not os.WIFSIGNALED(status), f"the open killed the process (signal {os.WTERMSIG(status)})"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert report is not None
    assert report["outcome"] in ("opened", "DeviceError"), report
    if report["outcome"] == "DeviceError":
        assert str(path) in report["message"]
    else:
        assert report["wrong"] == 0, report
    return report


def assert_counted(report: dict[str, Any]) -> None:
    """Every object the opened pool does not serve is a counted miss."""
    gone = OBJECTS - report["recovered"]
    assert gone <= report["corrupt_freed"], report
    assert report["missed"] == gone + report["checksum_misses"], report


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_bit_flips_never_kill_the_opener(pristine: Path, opener: Opener, tmp_path: Path,
                                                seed: int) -> None:
    rng = random.Random(f"pmem-damage-{seed}")
    bits = [rng.randrange(SPAN * 8) for _ in range(FLIPS)]
    path = damaged_copy(pristine, tmp_path / "damaged.pool", bits)
    report = assert_survived(path, *opener.open(path))
    if report["outcome"] == "opened":
        assert_counted(report)


def descriptor_field(pristine: Path, index: int) -> int:
    """Field `index` of the u64s after the layout name in PMDK 1.12's pool descriptor:
    ``lanes_offset, nlanes, heap_offset``."""
    with pristine.open("rb") as f:
        f.seek(layout.LAYOUT_OFFSET + layout.MAX_LAYOUT + 8 * index)
        (value,) = struct.unpack("<Q", f.read(8))
    return int(value)


def undo_log_next(pristine: Path) -> int:
    """A bit of the ``next`` offset of lane 37's undo log, which PMDK follows at open without
    a check (PMDK 1.12: lanes of 3 KiB, each an internal redo log of 192 bytes, an external
    one of 640 and the undo log, each behind a 64-byte header: checksum, next, capacity...)."""
    undo = (64 + 192) + (64 + 640)
    return (descriptor_field(pristine, 0) + 37 * 3072 + undo + 8) * 8 + 59


def heap_header(pristine: Path) -> int:
    """A bit of the heap header's major version, covered by its checksum: PMDK refuses the
    pool at open (errno -1 from its heap check)."""
    return (descriptor_field(pristine, 2) + 20) * 8


@pytest.mark.parametrize("fmt", [False, True], ids=["refused", "recreated"])
@pytest.mark.parametrize("damage", [undo_log_next, heap_header])
def test_a_damaged_pool_is_refused_or_recreated(pristine: Path, opener: Opener, tmp_path: Path,
                                                damage: Callable[[Path], int],
                                                fmt: bool) -> None:
    path = damaged_copy(pristine, tmp_path / "damaged.pool", [damage(pristine)])
    report = assert_survived(path, *opener.open(path, fmt=fmt))
    if not fmt:
        assert report["outcome"] == "DeviceError"
        return
    assert report["outcome"] == "opened"
    # replaced with a new pool: nothing of the old one, nothing counted as found corrupt
    assert (report["recovered"], report["missed"], report["corrupt_freed"]) == (0, OBJECTS, 0)
    recreated = PmemTier(PmemTierConfig("pmem", CAPACITY, path))

    async def roundtrip() -> bytes | None:
        await recreated.open()
        try:
            await recreated.put(b"new", ObjectMeta(ValueKind.BYTES, "", (), 3, 1), b"abc")
            got = await recreated.get(b"new")
            return None if got is None else bytes(got[1])
        finally:
            await recreated.close()

    assert asyncio.run(roundtrip()) == b"abc"


def test_a_silent_probe_is_killed_and_the_pool_left_whole(pristine: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # no damage here hangs PMDK on purpose; a stall limit shorter than the probe's open makes
    # a healthy probe "silent", and killing it mid-open must leave the pool as it was
    path = tmp_path / "whole.pool"
    shutil.copyfile(pristine, path)
    with monkeypatch.context() as patched:
        patched.setattr(_probe, "STALL", 0.001)
        with pytest.raises(_probe.Damaged):
            _probe.probe_open(path, layout.LAYOUT_NAME, layout.ROOT_SIZE)
    assert _probe.probe_open(path, layout.LAYOUT_NAME, layout.ROOT_SIZE) == OBJECTS


def test_a_probe_killed_from_outside_never_gets_a_valid_pool_replaced(
        pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGKILL (the OOM killer, an operator) says nothing about the pool: unlike a crash, it is
    # no reason to recreate the pool, even with format = true
    path = tmp_path / "whole.pool"
    shutil.copyfile(pristine, path)
    killer = tmp_path / "killed_probe.py"
    killer.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    with monkeypatch.context() as patched:
        patched.setattr(_probe, "_CHILD", killer)
        with pytest.raises(DeviceError) as raised:
            _probe.probe_open(path, layout.LAYOUT_NAME, layout.ROOT_SIZE)
        assert not isinstance(raised.value, _probe.Damaged)

        async def open_with_format() -> None:
            tier = PmemTier(PmemTierConfig("pmem", CAPACITY, path, format=True))
            with pytest.raises(DeviceError):
                await tier.open()

        asyncio.run(open_with_format())
    assert _probe.probe_open(path, layout.LAYOUT_NAME, layout.ROOT_SIZE) == OBJECTS



#: the real probe (its path in REAL), stalled in its walk: after PMDK opened the pool and took
#: its lock; it writes its pid into ARMED first
STALLED_PROBE = textwrap.dedent("""
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("probe_child", REAL)
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)

    def stalled_walk(*_args):
        with open(ARMED, "w") as armed:
            armed.write(str(os.getpid()))
        time.sleep(60)

    child._walk = stalled_walk
    child.main(sys.argv[1:])
""")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped holds no lock: not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.crash
def test_a_probe_dies_with_the_process_killed_during_its_open(pristine: Path,
                                                              tmp_path: Path) -> None:
    # a server killed with SIGKILL while its pool's open probe ran must not leave the probe
    # holding the pool's lock: its restart's open would be refused as "in use"
    path = tmp_path / "whole.pool"
    shutil.copyfile(pristine, path)
    armed = tmp_path / "armed"
    stalled = tmp_path / "stalled_probe.py"
    stalled.write_text(f"REAL = {str(_probe._CHILD)!r}\nARMED = {str(armed)!r}\n"
                       + STALLED_PROBE)
    script = (f"from pathlib import Path\nfrom tierkv.tiers.pmem import _probe\n"
              f"_probe._CHILD = Path({str(stalled)!r})\n"
              f"_probe.probe_open(Path({str(path)!r}), {layout.LAYOUT_NAME!r}, "
              f"{layout.ROOT_SIZE})\n")
    server = subprocess.Popen([sys.executable, "-c", script])
    probe_pid = None
    try:
        deadline = time.monotonic() + 60
        while not armed.exists() or not armed.read_text():
            assert server.poll() is None, "the process died before its probe stalled"
            assert time.monotonic() < deadline, "the stalled probe never started"
            time.sleep(0.01)
        probe_pid = int(armed.read_text())
        assert _alive(probe_pid)
        server.kill()
        server.wait()
        deadline = time.monotonic() + 10
        while _alive(probe_pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _alive(probe_pid), "the probe outlived the process killed during its open"
        # the restart opens the pool at once, whole
        assert _probe.probe_open(path, layout.LAYOUT_NAME, layout.ROOT_SIZE) == OBJECTS
    finally:
        server.kill()
        server.wait()
        if probe_pid is not None and _alive(probe_pid):
            os.kill(probe_pid, signal.SIGKILL)
