"""At open the newest region takes appends again (`tierkv.tiers.nvme._resume`).

The first append after an open rotated into a new region: in a full log a reclaim of the oldest
one, dropping what it did not copy forward, at every restart (a `kill -9` and reopen of a log
over half full lost a region of flushed objects). Each case fills a log until no region is free
and the head is half full, reopens it (after a clean close, or from a crash image: a scan),
appends, and checks that nothing was reclaimed and that every entry, old and new, is read back
byte for byte, then again after a crash image of the appended log.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.tiers._nvme_support import REGION, key, meta_of, nvme_config, payload_for
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier

SIZE = 8000


async def _put(tier: NvmeTier, i: int) -> None:
    data = payload_for(i, SIZE)
    assert await tier.put(key(i), meta_of(data), memoryview(data)) == []


def _full(tier: NvmeTier) -> bool:
    stats = tier.stats()
    return stats["regions_free"] <= stats["regions_reserved"] and tier.room() < REGION // 2


async def _all_there(tier: NvmeTier, count: int) -> None:
    assert set(tier.keys()) == {key(i) for i in range(count)}
    for i in range(count):
        got = await tier.get(key(i))
        assert got is not None and payload_bytes(got[1]) == payload_for(i, SIZE), i


def _crash_image(directory: Path, into: Path) -> Path:
    into.mkdir()
    shutil.copyfile(directory / "tier.log", into / "tier.log")
    return into


@pytest.mark.parametrize("how", ["closed", "crashed"])
async def test_a_full_log_reopened_appends_without_reclaiming(tmp_path: Path, how: str) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=4, reinsert_hits=0))
    await tier.open()
    count = 0
    try:
        while not _full(tier):
            await _put(tier, count)
            count += 1
        await tier.flush()
        if how == "crashed":
            media = _crash_image(tmp_path, tmp_path / "image")
    finally:
        await tier.close()
    if how == "closed":
        media = tmp_path
    again = NvmeTier(nvme_config(media, regions=4, reinsert_hits=0))
    await again.open()
    try:
        assert again.stats()["recovered_from"] == ("scan" if how == "crashed" else "checkpoint")
        for i in range(count, count + 4):
            await _put(again, i)
        assert again.stats()["regions_reclaimed"] == 0
        await _all_there(again, count + 4)
        await again.flush()
        image = _crash_image(media, tmp_path / "appended")
    finally:
        await again.close()
    for directory in (media, image):  # after its close, and after a crash once appended
        last = NvmeTier(nvme_config(directory, regions=4, reinsert_hits=0))
        await last.open()
        try:
            await _all_there(last, count + 4)
        finally:
            await last.close()
