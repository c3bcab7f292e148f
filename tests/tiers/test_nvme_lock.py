"""One nvme log, one opener: the tier holds an exclusive lock on its file while it is open.

A second opener, in another process or in this one, is refused with a `DeviceError` naming the
path and, where /proc/locks tells it, the holder's pid; so is `tierkv format` of an open log.
The holder's data is untouched by the refusal, and the lock dies with the holder (``kill -9``).

The holder runs as this module: ``python -m tests.tiers.test_nvme_lock MODE DIR`` opens (MODE
``tier``: an `NvmeTier`; ``engine``: a gpu + nvme engine) on DIR, puts `COUNT` objects, flushes,
prints ``READY <pid>`` and waits for a line on stdin; then it closes and prints ``CLOSED``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import hierarchy_config
from tests.tiers._nvme_support import key, meta_of, nvme_config, payload_for
from tierkv.errors import DeviceError
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.registry import wipe

ROOT = Path(__file__).resolve().parents[2]
COUNT = 200
SIZE = 3000
#: a holder that has not said READY (or CLOSED) by then is killed and the test fails (a hang)
LIMIT = 60.0


def engine_value(i: int) -> bytes:
    return payload_for(i, SIZE)


# -- the holder process --------------------------------------------------------------------------
async def hold_tier(directory: Path) -> None:
    tier = NvmeTier(nvme_config(directory))
    await tier.open()
    try:
        for i in range(COUNT):
            data = payload_for(i, SIZE)
            await tier.put(key(i), meta_of(data), memoryview(data))
        await tier.flush()
        print("READY", os.getpid(), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    finally:
        await tier.close()
    print("CLOSED", flush=True)


async def hold_engine(directory: Path) -> None:
    async with tierkv.open(hierarchy_config(directory, ("gpu", "nvme"))) as kv:
        for i in range(COUNT):
            await kv.put(f"held-{i}", engine_value(i))
        await kv.flush()
        print("READY", os.getpid(), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    print("CLOSED", flush=True)


class Holder:
    """A holder process (see the module docstring), started and waited for READY."""

    def __init__(self, mode: str, directory: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.tiers.test_nvme_lock", mode, str(directory)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        self.watchdog = threading.Timer(LIMIT, self.process.kill)
        self.watchdog.start()
        self.pid = int(self.expect("READY")[0])

    def expect(self, word: str) -> list[str]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        if not line or line[0] != word:
            self.process.kill()
            _out, err = self.process.communicate()
            pytest.fail(f"holder said {line} instead of {word}: {err}")
        return line[1:]

    def close(self) -> None:
        """Let the holder close its tier and exit; it must do so cleanly."""
        assert self.process.stdin is not None
        self.process.stdin.write("close\n")
        self.process.stdin.flush()
        self.expect("CLOSED")
        _out, err = self.process.communicate()
        assert self.process.returncode == 0, err

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.communicate()
        assert self.process.returncode == -signal.SIGKILL

    def stop(self) -> None:
        self.watchdog.cancel()
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.stop()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def assert_holds_all(tier: NvmeTier) -> None:
    for i in range(COUNT):
        got = await tier.get(key(i))
        assert got is not None, f"key {i} lost"
        assert payload_bytes(got[1]) == payload_for(i, SIZE)


# -- another process -----------------------------------------------------------------------------
async def test_a_second_process_is_refused_and_the_holders_data_kept(
        tmp_path: Path, holders: list[Holder]) -> None:
    config = nvme_config(tmp_path)
    holder = Holder("tier", tmp_path)
    holders.append(holder)
    before = digest(config.path)
    second = NvmeTier(config)
    with pytest.raises(DeviceError) as refused:
        await second.open()
    # the refusal names the file and the process holding it
    assert str(config.path) in str(refused.value)
    assert f"pid {holder.pid}" in str(refused.value)
    assert digest(config.path) == before  # the refused opener wrote nothing
    holder.close()

    reopened = NvmeTier(config)
    recovered = await reopened.open()
    try:
        assert {r.key for r in recovered} == {key(i) for i in range(COUNT)}
        await assert_holds_all(reopened)
    finally:
        await reopened.close()


async def test_the_lock_dies_with_a_killed_holder(tmp_path: Path, holders: list[Holder]) -> None:
    config = nvme_config(tmp_path)
    holder = Holder("tier", tmp_path)
    holders.append(holder)
    with pytest.raises(DeviceError):
        await NvmeTier(config).open()
    holder.kill()

    reopened = NvmeTier(config)
    await reopened.open()  # kill -9 left no stale lock: the kernel dropped it with the process
    try:
        assert reopened.stats()["recovered_from"] == "scan"
        await assert_holds_all(reopened)  # everything the holder flushed
    finally:
        await reopened.close()


#: locks the log, then hands its file to a child that keeps it a moment past the locker's exit:
#: how a killed process's io_uring holds its files (and their flocks) while the kernel tears
#: the ring down, after the process itself is gone
DEAD_LOCKER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
if os.fork() == 0:
    time.sleep(float(sys.argv[2]))
    os._exit(0)
os._exit(0)
"""


async def test_an_open_waits_a_moment_for_a_lock_no_live_process_holds(tmp_path: Path) -> None:
    """A lock whose holder has exited (the file kept open a moment longer, as a killed
    process's io_uring does while the kernel tears it down) is waited for, not refused: an
    open right after a kill -9 was refused as "in use" meanwhile."""
    config = nvme_config(tmp_path)
    tier = NvmeTier(config)
    await tier.open()
    await tier.close()
    locker = await asyncio.create_subprocess_exec(sys.executable, "-c", DEAD_LOCKER,
                                                  str(config.path), "0.5")
    assert await locker.wait() == 0  # the locker is gone; its child keeps the file
    reopened = NvmeTier(config)
    await reopened.open()
    await reopened.close()


async def test_a_second_engine_on_one_log_is_refused(tmp_path: Path,
                                                     holders: list[Holder]) -> None:
    """The issue's case: gpu + nvme opened twice; before the lock both ran to a clean close and
    the reopen found only one of them."""
    config = hierarchy_config(tmp_path, ("gpu", "nvme"))
    holder = Holder("engine", tmp_path)
    holders.append(holder)
    with pytest.raises(DeviceError):
        await tierkv.open(config)
    holder.close()

    async with tierkv.open(config) as kv:
        for i in range(COUNT):
            assert await kv.get(f"held-{i}") == engine_value(i), f"held-{i} lost"


# -- this process --------------------------------------------------------------------------------
async def test_a_second_tier_in_this_process_is_refused(tmp_path: Path) -> None:
    config = nvme_config(tmp_path)
    first = NvmeTier(config)
    await first.open()
    try:
        data = payload_for(1, SIZE)
        await first.put(key(1), meta_of(data), memoryview(data))
        await first.flush()
        with pytest.raises(DeviceError) as refused:
            await NvmeTier(config).open()
        assert str(config.path) in str(refused.value)
        got = await first.get(key(1))  # the first tier is unharmed
        assert got is not None and payload_bytes(got[1]) == data
    finally:
        await first.close()

    after = NvmeTier(config)  # closing released the lock
    recovered = await after.open()
    try:
        assert [r.key for r in recovered] == [key(1)]
    finally:
        await after.close()


async def test_wiping_an_open_log_is_refused(tmp_path: Path) -> None:
    config = nvme_config(tmp_path)
    tier = NvmeTier(config)
    await tier.open()
    try:
        data = payload_for(7, SIZE)
        await tier.put(key(7), meta_of(data), memoryview(data))
        await tier.flush()
        before = digest(config.path)
        with pytest.raises(DeviceError):
            wipe(config)
        assert digest(config.path) == before
        got = await tier.get(key(7))
        assert got is not None and payload_bytes(got[1]) == data
    finally:
        await tier.close()

    wipe(config)  # once closed, the wipe goes ahead
    assert config.path.stat().st_size == 0


async def test_a_failed_open_releases_the_lock(tmp_path: Path) -> None:
    config = nvme_config(tmp_path)
    config.path.write_bytes(b"not a tierkv log" * 1024)
    with pytest.raises(DeviceError):
        await NvmeTier(config).open()  # format = false: foreign media is refused
    wipe(config)  # refused if the failed open had kept its lock
    tier = NvmeTier(config)
    assert await tier.open() == []
    await tier.close()


def main() -> None:
    mode, directory = sys.argv[1], Path(sys.argv[2])
    asyncio.run(hold_tier(directory) if mode == "tier" else hold_engine(directory))


if __name__ == "__main__":
    main()
