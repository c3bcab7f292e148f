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
from typing import Any

import pytest

from tests.tiers._nvme_support import (
    REGION,
    flip_byte,
    key,
    meta_of,
    nvme_config,
    payload_for,
    walk_records,
)
from tierkv.errors import DeviceError
from tierkv.formats.header import ObjectHeader, checksum, encode_header
from tierkv.formats.nvme_layout import (
    ENTRY_GRANULARITY,
    SUPERBLOCK_SIZE,
    decode_superblock,
    entry_size,
)
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.io._blockio import BlockIO
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


class FailingWrites:
    """The tier's block device, every write failing (EIO) while `fail`."""

    def __init__(self, inner: BlockIO) -> None:
        self.inner = inner
        self.fail = False

    async def write(self, buf: Any, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        if self.fail:
            raise DeviceError("injected EIO", errno=5)
        await self.inner.write(buf, offset, length, start, urgent=urgent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_failed_write_in_a_resumed_head_keeps_its_tombstones(tmp_path: Path) -> None:
    """The resumed region held only tombstones (and a dead entry): a failed write above the
    resume point freed it, as a region holding nothing, its next use made the tombstones
    stale, and a crash brought the deleted value back."""
    config = nvme_config(tmp_path, regions=4, reinsert_hits=0)
    tier = NvmeTier(config)
    await tier.open()
    try:
        count = 0
        while tier.stats()["regions_used"] < 2:  # until a put rotates into a second region
            await _put(tier, count)
            count += 1
        assert await tier.delete(key(count - 1))  # the second region now holds nothing live
        assert await tier.delete(key(0))  # its record in the first, its tombstone in the second
        await tier.flush()
    finally:
        await tier.close()
    again = NvmeTier(config)
    devices: list[FailingWrites] = []

    def wrap(io: BlockIO) -> BlockIO:
        devices.append(FailingWrites(io))
        return devices[-1]

    again.wrap_io = wrap
    await again.open()
    try:
        devices[0].fail = True
        await _put(again, 10_000)
        with pytest.raises(DeviceError):
            await again.flush()
        devices[0].fail = False
        data = payload_for(10_001, SIZE)
        # the failed write dropped key 10000: this put reports it
        assert await again.put(key(10_001), meta_of(data), memoryview(data)) == [key(10_000)]
        await again.flush()
        image = _crash_image(tmp_path, tmp_path / "image")
    finally:
        await again.close()
    crashed = NvmeTier(nvme_config(image, regions=4, reinsert_hits=0))
    await crashed.open()
    try:
        assert await crashed.get(key(0)) is None
        got = await crashed.get(key(10_001))
        assert got is not None and payload_bytes(got[1]) == payload_for(10_001, SIZE)
    finally:
        await crashed.close()


async def test_nothing_is_appended_over_a_damaged_record_of_the_newest_region(
        tmp_path: Path) -> None:
    """K's newest record (two whole blocks: nothing pads after it) had a damaged prefix: the
    scan made K a miss (never the value before), but the resume point came before the record,
    the next append wrote over it, and after a crash the older value was served."""
    config = nvme_config(tmp_path, regions=4)
    tier = NvmeTier(config)
    await tier.open()
    try:
        old = b"v1" * 1000
        await tier.put(key(0), meta_of(old), memoryview(old))
        await tier.flush()  # pads to a block boundary: the next record starts a block
        size = 8192 - 200
        while True:
            new = payload_for(1, size)
            header = encode_header(ObjectHeader(key(0), meta_of(new, 2), checksum(new)))
            length = entry_size(len(header), size, ENTRY_GRANULARITY)
            if length == 8192:
                break
            size += 8192 - length if length < 8192 else -ENTRY_GRANULARITY
        await tier.put(key(0), meta_of(new, 2), memoryview(new))
        await tier.flush()
        image = _crash_image(tmp_path, tmp_path / "image")
    finally:
        await tier.close()
    [newest] = [r for r in walk_records((image / "tier.log").read_bytes())
                if r.key == key(0) and r.length == 8192]
    flip_byte(image / "tier.log", newest.at + 24, mask=1)  # a bit of its prefix's checksum
    damaged = NvmeTier(nvme_config(image, regions=4))
    await damaged.open()
    try:
        assert key(0) in damaged.damaged_at_open() and await damaged.get(key(0)) is None
        await _put(damaged, 7)
        await damaged.flush()
        again = _crash_image(image, tmp_path / "again")
    finally:
        await damaged.close()
    last = NvmeTier(nvme_config(again, regions=4))
    await last.open()
    try:
        assert await last.get(key(0)) is None
        got = await last.get(key(7))
        assert got is not None and payload_bytes(got[1]) == payload_for(7, SIZE)
    finally:
        await last.close()


async def test_a_region_whose_header_was_damaged_since_the_checkpoint_is_not_resumed(
        tmp_path: Path) -> None:
    """The checkpoint names the newest region and the open took it as the head without
    reading its header: appended to and flushed, then a crash, and the scan found the region
    the superblock named gone: what was flushed after the damage was lost, and every older
    region with it. Now only that region's own objects are lost."""
    config = nvme_config(tmp_path, regions=6, reinsert_hits=0)
    tier = NvmeTier(config)
    await tier.open()
    try:
        for i in range(4):  # a region's worth and a little more: the second is the head
            data = payload_for(i, 300_000)
            await tier.put(key(i), meta_of(data), memoryview(data))
    finally:
        await tier.close()
    log = tmp_path / "tier.log"
    sb = decode_superblock(log.read_bytes()[:SUPERBLOCK_SIZE])
    flip_byte(log, sb.region_offset(sb.newest_index) + 16, mask=1)
    damaged = NvmeTier(config)
    await damaged.open()
    try:
        await _put(damaged, 100)
        await damaged.flush()
        image = _crash_image(tmp_path, tmp_path / "image")
    finally:
        await damaged.close()
    crashed = NvmeTier(nvme_config(image, regions=6, reinsert_hits=0))
    await crashed.open()
    try:
        got = await crashed.get(key(100))
        assert got is not None and payload_bytes(got[1]) == payload_for(100, SIZE)
        first = await crashed.get(key(0))  # in the first region, undamaged
        assert first is not None and payload_bytes(first[1]) == payload_for(0, 300_000)
    finally:
        await crashed.close()
