"""The nvme log's flush holds its lock only to begin: appends go on while the device syncs.

A flush issues the head's unwritten part under the lock and then waits, syncs and records the
superblock outside it (`tierkv.tiers.nvme._flush`). The device here is the tier's real block
device (the threads backend, O_DIRECT on the work disk) whose `sync` waits at a gate the test
holds shut, as a drive whose fdatasync takes long: while one flush waits there, puts (rotating
the head into new regions), deletes and gets complete; the flush returns once the sync does; a
second flush begun meanwhile covers what was put after the first began; a flush cancelled in its
sync leaves the sync to finish and its failure for the next flush; a failed sync is raised by
every flush that was waiting on it and not by a later one. Each case reopens the log and checks
what a returned flush covered, byte for byte.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import pytest

from tests.tiers._nvme_support import key, meta_of, nvme_config, payload_for
from tierkv.errors import DeviceError
from tierkv.tiers.nvme.io._blockio import BlockIO
from tierkv.tiers.nvme.tier import NvmeTier

#: seconds an operation that must not wait for the gated sync may take
QUICK = 5.0
SIZE = 200_000  # five entries a 1 MiB region: 15 puts rotate the head three times


class GatedSync:
    """The tier's block device, its syncs held at `gate` while it is shut (open by default, so
    that the tier opens as usual); `entered` is set when a sync arrives at a shut gate, and a
    sync released with `fail` set fails with it instead of syncing."""

    def __init__(self, inner: BlockIO) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        self.fail: DeviceError | None = None
        self.syncs = 0

    async def sync(self) -> None:
        self.syncs += 1
        if not self.gate.is_set():
            self.entered.set()
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        await self.inner.sync()

    def shut(self) -> None:
        self.gate.clear()
        self.entered.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def open_gated(directory: Path, *, regions: int = 16,
                     fmt: bool = True) -> tuple[NvmeTier, GatedSync]:
    tier = NvmeTier(nvme_config(directory, regions=regions, fmt=fmt))
    gates: list[GatedSync] = []

    def wrap(io: BlockIO) -> BlockIO:
        gates.append(GatedSync(io))
        return gates[-1]

    tier.wrap_io = wrap
    await tier.open()
    return tier, gates[0]


async def put(tier: NvmeTier, i: int) -> None:
    data = payload_for(i, SIZE)
    await tier.put(key(i), meta_of(data), data)


async def reopened(directory: Path) -> dict[bytes, bytes]:
    tier = NvmeTier(nvme_config(directory, regions=16))
    await tier.open()
    try:
        held = {}
        for k in list(tier.keys()):
            got = await tier.get(k)
            assert got is not None
            held[k] = bytes(got[1])
        return held
    finally:
        await tier.close()


async def test_appends_go_on_while_a_flush_syncs(tmp_path: Path) -> None:
    tier, device = await open_gated(tmp_path)
    try:
        for i in range(8):
            await put(tier, i)
        device.shut()
        flush = asyncio.create_task(tier.flush())
        await asyncio.wait_for(device.entered.wait(), QUICK)
        # three regions' worth of puts: the head rotates and seals while the flush syncs
        for i in range(8, 23):
            await asyncio.wait_for(put(tier, i), QUICK)
        assert await asyncio.wait_for(tier.delete(key(3)), QUICK)
        got = await asyncio.wait_for(tier.get(key(20)), QUICK)
        assert got is not None and bytes(got[1]) == payload_for(20, SIZE)
        assert not flush.done()  # still in its sync, which held none of the above
        device.gate.set()
        await asyncio.wait_for(flush, QUICK)
    finally:
        device.gate.set()
        await tier.close()
    held = await reopened(tmp_path)
    expected = {key(i): payload_for(i, SIZE) for i in range(23) if i != 3}
    assert held == expected


async def test_a_flush_begun_during_another_covers_what_came_after(tmp_path: Path) -> None:
    """Two flushes in flight at once: the second covers puts made while the first synced, and
    neither returns before its sync. The superblock records stay in order (a later open finds
    the newest region use a flush recorded: nothing is dropped as unordered)."""
    tier, device = await open_gated(tmp_path)
    try:
        for i in range(4):
            await put(tier, i)
        device.shut()
        first = asyncio.create_task(tier.flush())
        await asyncio.wait_for(device.entered.wait(), QUICK)
        for i in range(4, 12):
            await asyncio.wait_for(put(tier, i), QUICK)
        second = asyncio.create_task(tier.flush())
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        device.gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), QUICK)
        assert tier.stats()["regions_unordered"] == 0
    finally:
        device.gate.set()
        await tier.close()
    assert await reopened(tmp_path) == {key(i): payload_for(i, SIZE) for i in range(12)}


async def test_a_flush_cancelled_in_its_sync_leaves_it_going(tmp_path: Path) -> None:
    """Cancelled while the device syncs, the flush's sync still ends (close waits for it) and a
    failure it meets is raised by the next flush; what was put before stays, across a reopen."""
    tier, device = await open_gated(tmp_path)
    try:
        for i in range(6):
            await put(tier, i)
        device.shut()
        flush = asyncio.create_task(tier.flush())
        await asyncio.wait_for(device.entered.wait(), QUICK)
        flush.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flush
        device.fail = DeviceError("injected: fdatasync failed", errno=errno.EIO)
        device.gate.set()
        with pytest.raises(DeviceError, match="fdatasync failed"):
            await asyncio.wait_for(tier.flush(), QUICK)
        device.fail = None
        await asyncio.wait_for(tier.flush(), QUICK)  # raised once: this one succeeds
    finally:
        device.gate.set()
        device.fail = None
        await tier.close()
    assert await reopened(tmp_path) == {key(i): payload_for(i, SIZE) for i in range(6)}


async def test_a_failed_sync_is_raised_by_each_flush_that_waited_on_it(tmp_path: Path) -> None:
    tier, device = await open_gated(tmp_path)
    try:
        for i in range(3):
            await put(tier, i)
        device.shut()
        first = asyncio.create_task(tier.flush())
        await asyncio.wait_for(device.entered.wait(), QUICK)
        await put(tier, 3)
        second = asyncio.create_task(tier.flush())
        await asyncio.sleep(0.05)
        device.fail = DeviceError("injected: fdatasync failed", errno=errno.EIO)
        device.gate.set()
        results = await asyncio.wait_for(
            asyncio.gather(first, second, return_exceptions=True), QUICK)
        assert all(isinstance(r, DeviceError) for r in results), results
        device.fail = None
        await asyncio.wait_for(tier.flush(), QUICK)
    finally:
        device.gate.set()
        device.fail = None
        await tier.close()
    assert await reopened(tmp_path) == {key(i): payload_for(i, SIZE) for i in range(4)}


async def test_close_waits_for_a_flush_in_its_sync(tmp_path: Path) -> None:
    """A close that starts while a flush syncs lets that flush end first (its superblock record
    and the checkpoint never cross), then checkpoints: the next open loads the checkpoint."""
    tier, device = await open_gated(tmp_path)
    for i in range(5):
        await put(tier, i)
    device.shut()
    flush = asyncio.create_task(tier.flush())
    await asyncio.wait_for(device.entered.wait(), QUICK)
    close = asyncio.create_task(tier.close())
    await asyncio.sleep(0.05)
    assert not close.done()
    device.gate.set()
    await asyncio.wait_for(asyncio.gather(flush, close), QUICK)
    again = NvmeTier(nvme_config(tmp_path, regions=16))
    await again.open()
    try:
        assert again.stats()["recovered_from"] == "checkpoint"
    finally:
        await again.close()
    assert await reopened(tmp_path) == {key(i): payload_for(i, SIZE) for i in range(5)}
