"""Modes of a persistent tier's media: who may read it, and how the nvme log is written.

Permissions: the nvme log and the pmem pool are created 0600 (they hold every tenant's data);
an existing file that lets its group or others in opens with a warning naming it and its mode.

IO mode: on a filesystem that refuses O_DIRECT the nvme log falls back to buffered IO, on the
first open too (the file created by it included), and an open that fails leaves no file it
created. Such filesystems are tmpfs before Linux 6.6 (``/dev/shm``) and ramfs, mounted in a user
and mount namespace of its own (``unshare``); each case skips with the reason where it cannot
run. The case runs as this module in a child process (``python -m tests.tiers.test_media_modes
DIR``, which prints its findings one per line), so that ramfs can be mounted for it and the file
size limit it needs binds it alone.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from tests.tiers._nvme_support import key, meta_of, nvme_config, payload_for
from tierkv.config import PmemTierConfig
from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.pmem import PmemTier

ROOT = Path(__file__).resolve().parents[2]
POOL_CAPACITY = 8 << 20
DATA = payload_for(3, 5000)
#: opens a tier on media under a directory and closes it again; returns the media's path
Opener = Callable[[Path], Awaitable[Path]]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def mode_warnings(caplog: pytest.LogCaptureFixture, path: Path, mode: int) -> list[str]:
    """Warnings naming `path` and `mode` (the pmem tier warns about emulated media as well)."""
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and str(path) in r.getMessage()
            and f"{mode:04o}" in r.getMessage()]


async def open_and_close_nvme(directory: Path) -> Path:
    config = nvme_config(directory)
    tier = NvmeTier(config)
    await tier.open()
    await tier.close()
    return config.path


async def open_and_close_pmem(directory: Path) -> Path:
    path = directory / "tier.pool"
    tier = PmemTier(PmemTierConfig("pmem", POOL_CAPACITY, path))
    await tier.open()
    await tier.close()
    return path


OPENERS = [
    pytest.param(open_and_close_nvme, id="nvme"),
    pytest.param(open_and_close_pmem, id="pmem", marks=pytest.mark.pmem),
]


# -- permissions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("open_and_close", OPENERS)
async def test_new_media_files_are_owner_only(tmp_path: Path, open_and_close: Opener) -> None:
    path = await open_and_close(tmp_path)
    assert mode_of(path) == 0o600


@pytest.mark.parametrize("open_and_close", OPENERS)
async def test_a_file_open_to_others_is_warned_at_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, open_and_close: Opener) -> None:
    path = await open_and_close(tmp_path)
    os.chmod(path, 0o644)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        await open_and_close(tmp_path)
    assert len(mode_warnings(caplog, path, 0o644)) == 1
    assert mode_of(path) == 0o644  # a warning only: the owner decides


@pytest.mark.parametrize("open_and_close", OPENERS)
async def test_an_owner_only_file_opens_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, open_and_close: Opener) -> None:
    path = await open_and_close(tmp_path)
    with caplog.at_level(logging.WARNING):
        await open_and_close(tmp_path)
    assert mode_warnings(caplog, path, 0o600) == []


# -- O_DIRECT refused ----------------------------------------------------------------------------
def refuses_o_direct(directory: Path) -> bool:
    fd, name = tempfile.mkstemp(dir=directory)
    os.close(fd)
    try:
        os.close(os.open(name, os.O_RDWR | os.O_DIRECT))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return True
    finally:
        os.unlink(name)
    return False


async def child(directory: Path) -> None:
    """The case itself (run in the child process): prints ``ACCEPTS`` where the filesystem
    takes O_DIRECT after all, else what the first open did and what a failing one left."""
    if not refuses_o_direct(directory):
        print("ACCEPTS", flush=True)
        return
    config = nvme_config(directory)  # direct = true
    tier = NvmeTier(config)
    try:
        await tier.open()
    except DeviceError as exc:
        print("FIRST_OPEN failed", exc, flush=True)
        print("LEFT_BEHIND", config.path.exists(), flush=True)
        return
    print("FIRST_OPEN ok", flush=True)
    print("IO", tier.describe()["io"].split()[0], flush=True)
    print("MODE", oct(mode_of(config.path)), flush=True)
    await tier.put(key(3), meta_of(DATA), memoryview(DATA))
    await tier.close()
    again = NvmeTier(config)
    await again.open()
    got = await again.get(key(3))
    print("KEPT", got is not None and payload_bytes(got[1]) == DATA, flush=True)
    await again.close()

    # a limit the superblock does not fit under: the new log cannot be sized, the open fails
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (SUPERBLOCK_SIZE // 2, SUPERBLOCK_SIZE // 2))
    failing = nvme_config(directory, name="failing.log")
    try:
        await NvmeTier(failing).open()
    except DeviceError:
        print("FAILING_OPEN raised", flush=True)
    else:
        print("FAILING_OPEN opened", flush=True)
    print("FAILING_LEFT_BEHIND", failing.path.exists(), flush=True)


def findings(command: list[str]) -> dict[str, str]:
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line.split(maxsplit=1) for line in done.stdout.splitlines() if line]
    return {words[0]: words[1] if len(words) > 1 else "" for words in lines}


CHILD = [sys.executable, "-m", "tests.tiers.test_media_modes"]


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    directory = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tierkv-test-"))
    try:
        if not refuses_o_direct(directory):
            pytest.skip("tmpfs at /dev/shm accepts O_DIRECT (Linux 6.6 or later)")
        yield directory
    finally:
        shutil.rmtree(directory)


def ramfs_command(directory: Path) -> list[str]:
    """`CHILD` on a ramfs mounted at `directory` in a namespace of its own; skips where that
    cannot be done (no unshare, user namespaces off)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("ramfs: no unshare(1) to mount it without privileges")
    mount = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
             'mount -t ramfs ramfs "$0" && exec "$@"', str(directory)]
    probe = subprocess.run([*mount, "true"], check=False, capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"ramfs: cannot mount one in a user namespace: {probe.stderr.strip()}")
    return [*mount, *CHILD, str(directory)]


def check_fallback(found: dict[str, str]) -> None:
    if "ACCEPTS" in found:
        pytest.skip("the filesystem accepts O_DIRECT after all")
    assert found.get("FIRST_OPEN") == "ok", found
    assert found["IO"] == "buffered"
    assert found["MODE"] == oct(0o600)
    assert found["KEPT"] == "True"
    assert found["FAILING_OPEN"] == "raised"
    assert found["FAILING_LEFT_BEHIND"] == "False"


def test_o_direct_refused_on_dev_shm(shm_dir: Path) -> None:
    check_fallback(findings([*CHILD, str(shm_dir)]))


def test_o_direct_refused_on_ramfs(tmp_path: Path) -> None:
    directory = tmp_path / "ramfs"
    directory.mkdir()
    check_fallback(findings(ramfs_command(directory)))
    assert list(directory.iterdir()) == []  # the mount went with its namespace


if __name__ == "__main__":
    asyncio.run(child(Path(sys.argv[1])))
