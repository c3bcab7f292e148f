"""What `format` means for the NVMe tier: one rule, whatever the media holds.

A usable log (a valid superblock of this version and of the configured region size and count)
is recovered, never wiped, with ``format = true`` as with ``false``. New media is formatted either
way: a file created by the open or of size 0, or a block device whose superblock is zeroed (what
`tierkv format` leaves; a loop device stands for one, where this runs as root). Anything else (a
foreign file, a file's zeroed or a damaged superblock, another version or geometry, a file
shorter than a superblock) is refused with a `DeviceError` naming the path and left byte for byte
as it was, unless ``format = true``, which formats it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.tiers._nvme_support import REGION, flip_byte, key, meta_of, nvme_config, payload_for
from tierkv.config import NvmeBackend
from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import (
    SUPERBLOCK_SIZE,
    Superblock,
    decode_superblock,
    encode_superblock,
)
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier

BACKENDS = [pytest.param(NvmeBackend.IO_URING, marks=pytest.mark.uring), NvmeBackend.THREADS]
#: objects of the log the damage cases start from (the issue lost 250 without an error)
COUNT = 250


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _data(i: int) -> bytes:
    return payload_for(i, 3000 + i)


async def _write_log(directory: Path, backend: NvmeBackend = NvmeBackend.THREADS) -> None:
    """A log of `COUNT` objects, closed cleanly (a checkpoint is recorded)."""
    tier = NvmeTier(nvme_config(directory, backend=backend))
    await tier.open()
    try:
        for i in range(COUNT):
            assert not await tier.put(key(i), meta_of(_data(i)), memoryview(_data(i)))
    finally:
        await tier.close()


async def _check_log(tier: NvmeTier) -> None:
    """`tier` (open) holds exactly the objects `_write_log` put, byte for byte."""
    assert set(tier.keys()) == {key(i) for i in range(COUNT)}
    for i in range(COUNT):
        got = await tier.get(key(i))
        assert got is not None and payload_bytes(got[1]) == _data(i)


async def _check_fresh(directory: Path, fmt: bool) -> None:
    """The path holds an empty log of the configured geometry that keeps what is put."""
    config = nvme_config(directory, fmt=fmt)
    tier = NvmeTier(config)
    assert await tier.open() == []
    try:
        await tier.put(key(1), meta_of(b"fresh"), memoryview(b"fresh"))
    finally:
        await tier.close()
    sb = decode_superblock(config.path.read_bytes()[:SUPERBLOCK_SIZE])
    assert (sb.region_size, sb.region_count) == (REGION, 4)
    again = NvmeTier(config)
    assert [r.key for r in await again.open()] == [key(1)]
    await again.close()


@pytest.mark.parametrize("backend", BACKENDS, ids=["uring", "threads"])
@pytest.mark.parametrize("recovery", ["checkpoint", "scan"])
async def test_format_true_keeps_a_valid_log(tmp_path: Path, backend: NvmeBackend,
                                             recovery: str) -> None:
    await _write_log(tmp_path, backend)
    if recovery == "scan":  # the superblock names no checkpoint once a tier opened it
        crash_image = tmp_path / "image"
        crash_image.mkdir()
        opened = NvmeTier(nvme_config(tmp_path, backend=backend))
        await opened.open()
        (crash_image / "tier.log").write_bytes((tmp_path / "tier.log").read_bytes())
        await opened.close()
        tmp_path = crash_image
    for _ in range(2):  # a config that keeps format = true keeps the log at every open
        tier = NvmeTier(nvme_config(tmp_path, backend=backend, fmt=True))
        await tier.open()
        try:
            assert tier.stats()["recovered_from"] == recovery
            await _check_log(tier)
        finally:
            await tier.close()
        recovery = "checkpoint"


def _foreign(path: Path) -> None:
    path.write_bytes(os.urandom(3 * REGION))


def _short(path: Path) -> None:
    path.write_bytes(b"some other file")


def _zeroed(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(bytes(SUPERBLOCK_SIZE))


def _damaged(path: Path) -> None:
    flip_byte(path, 33)  # inside region_count: the superblock checksum no longer holds


def _version(path: Path) -> None:
    sb = decode_superblock(path.read_bytes()[:SUPERBLOCK_SIZE])
    with path.open("r+b") as f:
        f.write(encode_superblock(replace(sb, version=sb.version + 1)))


def _geometry(path: Path) -> None:
    sb = Superblock(REGION, SUPERBLOCK_SIZE + 3 * REGION, 3, os.urandom(16), 4096)
    with path.open("r+b") as f:
        f.write(encode_superblock(sb))


UNUSABLE = {"foreign": _foreign, "short": _short, "zeroed": _zeroed, "damaged": _damaged,
            "version": _version, "geometry": _geometry}


@pytest.mark.parametrize("media", list(UNUSABLE))
async def test_unusable_media_is_refused_untouched(tmp_path: Path, media: str) -> None:
    await _write_log(tmp_path)
    path = tmp_path / "tier.log"
    UNUSABLE[media](path)
    before = _digest(path)
    tier = NvmeTier(nvme_config(tmp_path))
    with pytest.raises(DeviceError, match=r"tier\.log"):
        await tier.open()
    await tier.close()
    assert _digest(path) == before


@pytest.mark.parametrize("media", list(UNUSABLE))
async def test_format_true_overwrites_unusable_media(tmp_path: Path, media: str) -> None:
    await _write_log(tmp_path)
    UNUSABLE[media](tmp_path / "tier.log")
    await _check_fresh(tmp_path, fmt=True)


@pytest.mark.parametrize("fmt", [False, True], ids=["keep", "format"])
async def test_empty_file_is_formatted(tmp_path: Path, fmt: bool) -> None:
    (tmp_path / "tier.log").touch()
    await _check_fresh(tmp_path, fmt)


@pytest.mark.parametrize("fmt", [False, True], ids=["keep", "format"])
async def test_new_file_is_formatted(tmp_path: Path, fmt: bool) -> None:
    await _check_fresh(tmp_path, fmt)
    assert os.listdir(tmp_path) == ["tier.log"]


# -- block devices -------------------------------------------------------------------------------
@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[Path]:
    """A loop block device over a zeroed image of the default test geometry."""
    tool = shutil.which("losetup")
    if os.geteuid() != 0 or tool is None:
        pytest.skip("a loop block device needs root and losetup")
    image = tmp_path / "image"
    with image.open("wb") as f:
        f.truncate(SUPERBLOCK_SIZE + 4 * REGION)
    attached = subprocess.run([tool, "--find", "--show", str(image)], capture_output=True,
                              text=True, check=False)
    if attached.returncode != 0:
        pytest.skip(f"no loop device: {attached.stderr.strip()}")
    device = Path(attached.stdout.strip())
    try:
        yield device
    finally:
        subprocess.run([tool, "--detach", str(device)], check=False)


def _on_device(directory: Path, device: Path, *, fmt: bool) -> NvmeTier:
    return NvmeTier(replace(nvme_config(directory, fmt=fmt), path=device))


def _read_head(device: Path) -> bytes:
    with device.open("rb") as f:
        return f.read(2 * SUPERBLOCK_SIZE)


async def test_zeroed_block_device_is_new_and_then_kept(tmp_path: Path,
                                                        loop_device: Path) -> None:
    tier = _on_device(tmp_path, loop_device, fmt=False)
    assert await tier.open() == []
    try:
        for i in range(COUNT):
            await tier.put(key(i), meta_of(_data(i)), memoryview(_data(i)))
    finally:
        await tier.close()
    for fmt in (False, True):
        again = _on_device(tmp_path, loop_device, fmt=fmt)
        await again.open()
        try:
            await _check_log(again)
        finally:
            await again.close()


async def test_foreign_block_device_is_refused_untouched(tmp_path: Path,
                                                         loop_device: Path) -> None:
    with loop_device.open("r+b") as f:
        f.write(os.urandom(SUPERBLOCK_SIZE))
        f.flush()
        os.fsync(f.fileno())
    before = _read_head(loop_device)
    tier = _on_device(tmp_path, loop_device, fmt=False)
    with pytest.raises(DeviceError, match=loop_device.name):
        await tier.open()
    await tier.close()
    assert _read_head(loop_device) == before
    forced = _on_device(tmp_path, loop_device, fmt=True)
    assert await forced.open() == []
    await forced.close()


async def test_a_block_device_in_use_is_refused_through_another_node(
        tmp_path: Path, loop_device: Path) -> None:
    """A second device node of the same block device (as two containers' /dev have): a tier
    and a wipe through it are refused while a tier holds the device. The flock is per node, and
    both engines opened the log, each overwriting the other's regions; a wipe zeroed it."""
    alias = tmp_path / "alias"
    try:
        os.mknod(alias, stat.S_IFBLK | 0o600, os.stat(loop_device).st_rdev)
    except OSError as exc:
        pytest.skip(f"cannot make a second device node here: {exc.strerror}")
    tier = _on_device(tmp_path, loop_device, fmt=False)
    await tier.open()
    try:
        await tier.put(key(1), meta_of(_data(1)), memoryview(_data(1)))
        await tier.flush()
        other = _on_device(tmp_path, alias, fmt=False)
        with pytest.raises(DeviceError, match="in use"):
            await other.open()
        await other.close()
        config = tmp_path / "alias.toml"
        config.write_text(f'[[tiers]]\nname = "nvme"\nkind = "nvme"\npath = "{alias}"\n'
                          f'capacity = {SUPERBLOCK_SIZE + 4 * REGION}\n'
                          f'region_size = {REGION}\n')
        wipe = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "tierkv.cli", "format", "--config",
                             str(config), "--yes"], capture_output=True, text=True, check=False)
        assert wipe.returncode == 1 and "in use" in wipe.stderr, wipe.stderr
    finally:
        await tier.close()
    again = _on_device(tmp_path, alias, fmt=False)  # free once the holder closed
    await again.open()
    try:
        got = await again.get(key(1))
        assert got is not None and bytes(got[1]) == _data(1)
    finally:
        await again.close()
