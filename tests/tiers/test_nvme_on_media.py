"""`NvmeTier.on_media`: a copy is on media for sure only once a sync covered its write.

The engine records the edges of keys held nowhere on media ahead of a copy derived from them
(`engine._departed`); a log copy counted as on media while it sat in the head's buffer, or in a
region written since the last sync, so a `kill -9` lost it with its edges while the derived
copy came back, linked to nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from tests.tiers._nvme_support import REGION, key, meta_of, nvme_config, payload_for
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.tiers.nvme.io._blockio import BlockIO
from tierkv.tiers.nvme.tier import NvmeTier


class HeldWrites:
    """The tier's block device, its writes into a region past `start` held while `hold`."""

    def __init__(self, inner: BlockIO, region_size: int, start: int) -> None:
        self.inner = inner
        self.region_size = region_size
        self.start = start
        self.hold = False
        self.release = asyncio.Event()
        self.held = 0

    async def write(self, buf: Any, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        if self.hold and (offset - SUPERBLOCK_SIZE) % self.region_size >= self.start:
            self.held += 1
            await self.release.wait()
        await self.inner.write(buf, offset, length, start, urgent=urgent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _put(tier: NvmeTier, i: int, size: int = 8000) -> None:
    data = payload_for(i, size)
    await tier.put(key(i), meta_of(data), memoryview(data))


async def test_a_copy_in_the_head_is_on_media_once_a_flush_synced_it(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=4))
    await tier.open()
    try:
        await _put(tier, 0)
        assert not tier.on_media(key(0))  # in the head's buffer
        await tier.flush()
        assert tier.on_media(key(0))
        await _put(tier, 1)  # the same head, after the flush
        assert tier.on_media(key(0)) and not tier.on_media(key(1))
        await tier.flush()
        assert tier.on_media(key(1))
    finally:
        await tier.close()


async def test_a_sealed_region_is_on_media_once_a_later_sync_ended(tmp_path: Path) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=4))
    await tier.open()
    try:
        count = REGION // 8000 + 10  # a region's worth and more: the first is sealed
        for i in range(count):
            await _put(tier, i)
        for _ in range(500):  # its write ends in the background
            if tier.stats()["bytes_written"] >= REGION // 2:
                break
            await asyncio.sleep(0.01)
        assert tier.stats()["bytes_written"] >= REGION // 2
        assert not tier.on_media(key(0))  # written, not synced
        await tier.flush()
        assert all(tier.on_media(key(i)) for i in range(count))
    finally:
        await tier.close()


async def test_a_write_issued_after_a_flush_began_is_not_counted_synced_by_it(
        tmp_path: Path) -> None:
    """A put that runs between a flush's start and its task's (the lock free, the task not yet
    run) issues a write-behind the flush does not wait for: the flush counted it synced all the
    same, while it was not even written."""
    region = 4 << 20
    config = dataclasses.replace(nvme_config(tmp_path, regions=4), region_size=region,
                                 capacity=SUPERBLOCK_SIZE + 4 * region)
    tier = NvmeTier(config)
    devices: list[HeldWrites] = []

    def wrap(io: BlockIO) -> BlockIO:
        devices.append(HeldWrites(io, region, start=3 * 4096))
        return devices[-1]

    tier.wrap_io = wrap
    await tier.open()
    device = devices[0]
    try:
        await _put(tier, 0)
        await tier.flush()  # the head's header and key 0, synced
        device.hold = True
        # ready in this order: the puts run once the flush let its lock go, before its task
        flush = asyncio.create_task(tier.flush())
        first = asyncio.create_task(_put(tier, 1, 300_000))
        second = asyncio.create_task(_put(tier, 2, 1_000_000))  # a whole chunk: written behind
        await asyncio.wait_for(asyncio.gather(flush, first, second), 10)
        assert device.held  # key 1's write is held: not on the device, never synced
        assert tier.on_media(key(0)) and not tier.on_media(key(1))
    finally:
        device.release.set()
        await tier.close()


class CountedSyncs:
    def __init__(self, inner: BlockIO) -> None:
        self.inner = inner
        self.syncs = 0

    async def sync(self) -> None:
        self.syncs += 1
        await self.inner.sync()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_what_a_scan_finds_after_a_crash_is_synced_before_it_counts(
        tmp_path: Path) -> None:
    """A crash can leave records written and never synced; the scan at the next open finds
    them, and `on_media` says they outlive a machine crash: the open syncs them first."""
    tier = NvmeTier(nvme_config(tmp_path, regions=4))
    await tier.open()
    try:
        for i in range(REGION // 8000 + 10):  # the first region sealed and written
            await _put(tier, i)
        for _ in range(500):
            if tier.stats()["bytes_written"] >= REGION // 2:
                break
            await asyncio.sleep(0.01)
        image = tmp_path / "image"
        image.mkdir()
        (image / "tier.log").write_bytes((tmp_path / "tier.log").read_bytes())  # a kill -9
    finally:
        await tier.close()
    crashed = NvmeTier(nvme_config(image, regions=4))
    devices: list[CountedSyncs] = []

    def wrap(io: BlockIO) -> BlockIO:
        devices.append(CountedSyncs(io))
        return devices[-1]

    crashed.wrap_io = wrap
    await crashed.open()
    try:
        assert crashed.stats()["recovered_from"] == "scan"
        assert devices[0].syncs >= 1
        assert crashed.on_media(key(0))
    finally:
        await crashed.close()


class HeldHeaders:
    """The tier's block device, its writes of region headers (a region's first block) held
    while `hold`; the offsets of its other writes into regions, in the order they came."""

    def __init__(self, inner: BlockIO, region_size: int) -> None:
        self.inner = inner
        self.region_size = region_size
        self.hold = False
        self.release = asyncio.Event()
        self.held = 0
        self.others: list[int] = []

    async def write(self, buf: Any, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        if offset >= SUPERBLOCK_SIZE and (offset - SUPERBLOCK_SIZE) % self.region_size == 0:
            if self.hold:
                self.held += 1
                await self.release.wait()
        elif offset >= SUPERBLOCK_SIZE:
            self.others.append(offset)
        await self.inner.write(buf, offset, length, start, urgent=urgent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_no_record_of_a_region_use_reaches_the_device_before_its_header(
        tmp_path: Path) -> None:
    """A head's header write and its write-behind ran side by side: a crash could leave a
    record of the use on the device and its header not, the old header standing; the next
    open issued the use's seq again, and a later use given it took that record for its own."""
    region = 4 << 20
    config = dataclasses.replace(nvme_config(tmp_path, regions=4), region_size=region,
                                 capacity=SUPERBLOCK_SIZE + 4 * region)
    tier = NvmeTier(config)
    devices: list[HeldHeaders] = []

    def wrap(io: BlockIO) -> BlockIO:
        devices.append(HeldHeaders(io, region))
        return devices[-1]

    tier.wrap_io = wrap
    await tier.open()
    device = devices[0]
    try:
        device.hold = True
        for i in range(3):  # 3 MB: whole chunks are written behind while the header waits
            await _put(tier, i, 1_000_000)
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert device.held == 1
        assert device.others == []
        device.release.set()
        await tier.flush()
        assert device.others and all(tier.on_media(key(i)) for i in range(3))
    finally:
        device.release.set()
        await tier.close()
