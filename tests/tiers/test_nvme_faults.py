"""Bad paths, foreign formats and device errors of the NVMe tier.

Device errors are real kernel errors, produced without root tricks: a write error by running the
writer under a lowered RLIMIT_FSIZE (the kernel's write path then fails writes past the limit
with EFBIG, on both backends), and a read error by truncating the tier's file under it (a read
past the end returns nothing, which the tier reports as EIO). EIO/ENOSPC from real media are not
produced here; they take the same code path (a negative completion result or OSError errno).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.tiers._nvme_support import REGION, key, meta_of, nvme_config, payload_for
from tierkv.config import NvmeBackend
from tierkv.errors import ConfigError, DeviceError
from tierkv.formats.nvme_layout import (
    LAYOUT_VERSION,
    SUPERBLOCK_SIZE,
    Superblock,
    encode_superblock,
)
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier, probe

ROOT = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("_nvme_writer.py")
BACKENDS = [pytest.param(NvmeBackend.IO_URING, marks=pytest.mark.uring), NvmeBackend.THREADS]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_uncreatable_path_names_it(tmp_path: Path) -> None:
    config = nvme_config(tmp_path / "missing" / "dir")
    tier = NvmeTier(config)
    with pytest.raises(DeviceError, match="missing"):
        await tier.open()
    await tier.close()
    assert not (tmp_path / "missing").exists()


async def test_directory_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tier.log").mkdir()
    tier = NvmeTier(nvme_config(tmp_path))
    with pytest.raises(DeviceError, match=r"tier\.log"):
        await tier.open()


def test_capacity_below_superblock_and_region(tmp_path: Path) -> None:
    config = replace(nvme_config(tmp_path), capacity=SUPERBLOCK_SIZE + REGION - 1)
    with pytest.raises(ConfigError, match=r"tier\.log"):
        NvmeTier(config)


@pytest.mark.parametrize("content", ["random", "short", "version", "geometry"])
async def test_foreign_media_is_left_alone(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tier.log"
    if content == "random":
        path.write_bytes(os.urandom(3 * REGION))
    elif content == "short":
        path.write_bytes(b"some other file")
    elif content == "version":
        sb = Superblock(REGION, 5 * REGION, 4, os.urandom(16), 4096, version=LAYOUT_VERSION + 1)
        path.write_bytes(encode_superblock(sb) + bytes(REGION))
    else:
        sb = Superblock(2 * REGION, 9 * REGION, 4, os.urandom(16), 4096)
        path.write_bytes(encode_superblock(sb) + bytes(REGION))
    before = _digest(path)
    tier = NvmeTier(nvme_config(tmp_path))
    with pytest.raises(DeviceError, match=r"tier\.log"):
        await tier.open()
    assert _digest(path) == before

    forced = NvmeTier(nvme_config(tmp_path, fmt=True))
    assert await forced.open() == []
    try:
        await forced.put(key(1), meta_of(b"fresh"), memoryview(b"fresh"))
        got = await forced.get(key(1))
        assert got is not None and payload_bytes(got[1]) == b"fresh"
    finally:
        await forced.close()
    assert _digest(path) != before


async def test_format_true_keeps_own_log(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path))
    await tier.open()
    await tier.put(key(1), meta_of(b"old"), memoryview(b"old"))
    await tier.close()
    again = NvmeTier(nvme_config(tmp_path, fmt=True))
    try:
        assert [r.key for r in await again.open()] == [key(1)]
        got = await again.get(key(1))
        assert got is not None and payload_bytes(got[1]) == b"old"
    finally:
        await again.close()


@pytest.mark.parametrize("backend", BACKENDS, ids=["uring", "threads"])
async def test_read_error_is_device_error(tmp_path: Path, backend: NvmeBackend) -> None:
    tier = NvmeTier(nvme_config(tmp_path, backend=backend))
    await tier.open()
    try:
        for i in range(300):  # region 0 is sealed and written; reads of it go to the device
            data = payload_for(i, 5000)
            await tier.put(key(i), meta_of(data), memoryview(data))
        await tier.flush()
        os.truncate(tmp_path / "tier.log", SUPERBLOCK_SIZE)
        with pytest.raises(DeviceError) as caught:
            await tier.get(key(0))
        assert caught.value.errno == errno.EIO
        # the index still holds the key: a device error is not a checksum failure
        assert await tier.contains(key(0))
        assert tier.stats()["checksum_failures"] == 0
    finally:
        await tier.close()


@pytest.mark.parametrize("backend", BACKENDS, ids=["uring", "threads"])
def test_write_error_is_device_error(tmp_path: Path, backend: NvmeBackend) -> None:
    async def format_file() -> None:
        setup = NvmeTier(nvme_config(tmp_path, backend=backend))
        await setup.open()  # formats the file at its full size before the limit applies
        await setup.close()

    asyncio.run(format_file())
    limit = SUPERBLOCK_SIZE + REGION  # writes to region 1 and beyond fail
    result = subprocess.run(
        [sys.executable, str(WRITER), "fsize", str(tmp_path), backend.value, str(limit)],
        capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
        timeout=60, check=False,
    )
    out = result.stdout.decode().split("\n")
    assert result.returncode == 0, result.stderr.decode()
    assert f"DEVICE_ERROR {errno.EFBIG}" in out
    assert "FIRST hit" in out  # what region 0 held was written before the limit and stays


def test_probe_changes_nothing(tmp_path: Path) -> None:
    config = nvme_config(tmp_path)
    info = probe(config)
    assert info["path_exists"].startswith("no")
    assert not config.path.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.direct
def test_probe_finds_o_direct(tmp_path: Path) -> None:
    assert probe(nvme_config(tmp_path))["o_direct"] == "supported"
