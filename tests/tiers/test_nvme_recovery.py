"""Recovery of the NVMe tier: checkpoint after a clean close, scan without one, corrupt
checkpoint falling back to a scan, and what a crash image (the media as left at a given moment)
brings back."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from tests.tiers._nvme_support import (
    REGION,
    find_unique,
    flip_byte,
    key,
    meta_of,
    nvme_config,
    payload_for,
)
from tierkv.config import NvmeBackend
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE, decode_superblock
from tierkv.formats.value import encode_value
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier

BACKENDS = [pytest.param(NvmeBackend.IO_URING, marks=pytest.mark.uring), NvmeBackend.THREADS]


@pytest.fixture(params=BACKENDS, ids=["uring", "threads"])
def backend(request: pytest.FixtureRequest) -> NvmeBackend:
    value: NvmeBackend = request.param
    return value


async def _fill(tier: NvmeTier, count: int, size: int = 3000) -> dict[bytes, bytes]:
    datas = {key(i): payload_for(i, size + i) for i in range(count)}
    for k, v in datas.items():
        assert not await tier.put(k, meta_of(v), memoryview(v))
    return datas


async def _check(tier: NvmeTier, datas: dict[bytes, bytes]) -> None:
    for k, v in datas.items():
        got = await tier.get(k)
        assert got is not None, k
        assert payload_bytes(got[1]) == v


@pytest.fixture
async def reopened() -> AsyncIterator[list[NvmeTier]]:
    tiers: list[NvmeTier] = []
    yield tiers
    for tier in tiers:
        await tier.close()


async def test_clean_close_uses_checkpoint(
    tmp_path: Path, backend: NvmeBackend, reopened: list[NvmeTier]
) -> None:
    config = nvme_config(tmp_path, backend=backend)
    tier = NvmeTier(config)
    await tier.open()
    datas = await _fill(tier, 300)  # spans regions: sealed ones and a partial head
    tensor = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    tmeta, tpayload = encode_value(tensor, parents=(key(1),))
    await tier.put(b"\x02tensor", tmeta.with_generation(9), tpayload)
    await tier.close()
    sb = decode_superblock(config.path.read_bytes()[:SUPERBLOCK_SIZE])
    assert sb.checkpoint_length > 0

    again = NvmeTier(config)
    reopened.append(again)
    recovered = await again.open()
    assert again.stats()["recovered_from"] == "checkpoint"
    by_key = {r.key: r.meta for r in recovered}
    assert set(by_key) == {*datas, b"\x02tensor"}
    assert by_key[b"\x02tensor"] == tmeta.with_generation(9)
    await _check(again, datas)
    # the checkpoint is consumed at open: a crash from now on must scan, not trust it
    assert decode_superblock(config.path.read_bytes()[:SUPERBLOCK_SIZE]).checkpoint_length == 0


async def test_crash_image_is_scanned(
    tmp_path: Path, backend: NvmeBackend, reopened: list[NvmeTier]
) -> None:
    config = nvme_config(tmp_path, backend=backend)
    tier = NvmeTier(config)
    await tier.open()
    datas = await _fill(tier, 300)
    await tier.delete(key(5))
    overwritten = b"new value" * 100
    await tier.put(key(6), meta_of(overwritten, 2), memoryview(overwritten))
    await tier.flush()
    unflushed = b"never flushed" * 10
    await tier.put(b"\x02late", meta_of(unflushed), memoryview(unflushed))
    image = tmp_path / "image.log"
    shutil.copyfile(config.path, image)  # the media as a crash at this moment leaves it
    await tier.close()

    again = NvmeTier(nvme_config(tmp_path, backend=backend, name="image.log"))
    reopened.append(again)
    recovered = await again.open()
    assert again.stats()["recovered_from"] == "scan"
    del datas[key(5)]
    datas[key(6)] = overwritten
    assert {r.key for r in recovered} == set(datas)
    await _check(again, datas)
    assert again.stats()["checksum_failures"] == 0
    # new puts after a scan land in fresh regions and survive the next clean reopen
    await again.put(b"\x02after", meta_of(b"after"), memoryview(b"after"))


async def test_corrupt_checkpoint_falls_back_to_scan(
    tmp_path: Path, backend: NvmeBackend, reopened: list[NvmeTier]
) -> None:
    config = nvme_config(tmp_path, backend=backend)
    tier = NvmeTier(config)
    await tier.open()
    datas = await _fill(tier, 50)
    await tier.close()
    sb = decode_superblock(config.path.read_bytes()[:SUPERBLOCK_SIZE])
    region = sb.checkpoint_regions[0]
    flip_byte(config.path, SUPERBLOCK_SIZE + region * REGION + 40)

    again = NvmeTier(config)
    reopened.append(again)
    recovered = await again.open()
    assert again.stats()["recovered_from"] == "scan"
    assert {r.key for r in recovered} == set(datas)
    await _check(again, datas)


async def test_checkpoint_skipped_when_no_region_is_free(
    tmp_path: Path, reopened: list[NvmeTier]
) -> None:
    config = nvme_config(tmp_path, regions=2)
    tier = NvmeTier(config)
    await tier.open()
    live: dict[bytes, bytes] = {}
    for i in range(400):  # more than two regions hold: reclaim happens, no region stays free
        data = payload_for(i, 4000)
        for gone in await tier.put(key(i), meta_of(data), memoryview(data)):
            live.pop(gone, None)
        live[key(i)] = data
    await tier.close()
    assert tier.stats()["checkpoint_skipped"] == 1
    again = NvmeTier(config)
    reopened.append(again)
    recovered = await again.open()
    assert again.stats()["recovered_from"] == "scan"
    # a scan may also find entries the tier had dropped but not yet overwritten; each is intact
    assert set(live) <= {r.key for r in recovered}
    for r in recovered:
        got = await again.get(r.key)
        assert got is not None
        index = int(r.key.rsplit(b"-", 1)[1])
        assert payload_bytes(got[1]) == payload_for(index, 4000)


async def test_reopen_after_scan_then_checkpoint(tmp_path: Path, reopened: list[NvmeTier]) -> None:
    config = nvme_config(tmp_path)
    tier = NvmeTier(config)
    await tier.open()
    datas = await _fill(tier, 20)
    await tier.flush()
    image = tmp_path / "image.log"
    shutil.copyfile(config.path, image)
    await tier.close()
    crashed = NvmeTier(nvme_config(tmp_path, name="image.log"))
    await crashed.open()
    more = {b"\x02more": b"more data"}
    await crashed.put(b"\x02more", meta_of(more[b"\x02more"]), memoryview(more[b"\x02more"]))
    await crashed.close()
    again = NvmeTier(nvme_config(tmp_path, name="image.log"))
    reopened.append(again)
    recovered = await again.open()
    assert again.stats()["recovered_from"] == "checkpoint"
    assert {r.key for r in recovered} == set(datas) | set(more)
    await _check(again, {**datas, **more})
    assert find_unique(image, b"more data") > SUPERBLOCK_SIZE


async def test_a_sparse_log_is_allocated_in_full_at_open(
    tmp_path: Path, reopened: list[NvmeTier]
) -> None:
    """A log copied or restored sparse (its unused regions holes) gets its blocks at open, as a
    new one does: a region write must never meet a full file system later."""
    config = nvme_config(tmp_path, regions=8)
    tier = NvmeTier(config)
    await tier.open()
    datas = await _fill(tier, 20)  # the first region; the rest stay zeros
    await tier.close()
    sparse = tmp_path / "sparse.log"
    data = config.path.read_bytes()
    with sparse.open("wb") as out:  # what `cp --sparse=always` writes: no block of zeros
        for offset in range(0, len(data), 4096):
            block = data[offset:offset + 4096]
            if block.count(0) != len(block):
                out.seek(offset)
                out.write(block)
        out.truncate(len(data))
    size = sparse.stat().st_size
    assert sparse.stat().st_blocks * 512 < size  # holes where the unused regions are
    sparse.replace(config.path)

    again = NvmeTier(config)
    reopened.append(again)
    await again.open()
    assert config.path.stat().st_blocks * 512 >= size
    await _check(again, datas)
