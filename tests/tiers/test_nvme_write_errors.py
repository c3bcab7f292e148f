"""A region write that raises anything, not only `DeviceError`, counts as a failed write.

The log's background writes recorded a failure only as a `DeviceError`; anything else a block
device raised escaped their task unseen. A failed header left the writes waiting for it waiting
for good (the next flush hung), and a failed write of a sealed region's records left it counted
as written, so a flush returned on objects the media did not hold.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.tiers._nvme_support import BLOCK, REGION, key, meta_of, nvme_config, payload_for
from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.tiers.nvme.io._blockio import BlockIO
from tierkv.tiers.nvme.tier import NvmeTier

SIZE = 64_000


class RaisingWrites:
    """The tier's block device; while `broken`, its writes from `start` bytes into a region
    raise an error that is not a `DeviceError` (a defect of a backend, say)."""

    def __init__(self, inner: BlockIO, start: int) -> None:
        self.inner = inner
        self.start = start
        self.broken = False
        self.raised = 0

    async def write(self, buf: Any, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        if self.broken and (offset - SUPERBLOCK_SIZE) % REGION >= self.start:
            self.raised += 1
            raise RuntimeError("the backend broke")
        await self.inner.write(buf, offset, length, start, urgent=urgent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _put(tier: NvmeTier, i: int) -> None:
    data = payload_for(i, SIZE)
    await asyncio.wait_for(tier.put(key(i), meta_of(data), memoryview(data)), 10)


@pytest.mark.parametrize("start", [0, BLOCK], ids=["header", "records"])
async def test_a_write_that_raised_anything_fails_the_flush(tmp_path: Path, start: int) -> None:
    tier = NvmeTier(nvme_config(tmp_path, regions=6))
    devices: list[RaisingWrites] = []

    def wrap(io: BlockIO) -> BlockIO:
        devices.append(RaisingWrites(io, start))
        return devices[-1]

    tier.wrap_io = wrap
    await tier.open()
    count = 2 * REGION // SIZE  # two regions' worth: the first is sealed and written behind
    try:
        devices[0].broken = True
        for i in range(count):
            await _put(tier, i)
        with pytest.raises(DeviceError, match="the backend broke"):
            await asyncio.wait_for(tier.flush(), 10)
        assert devices[0].raised
        devices[0].broken = False
        for i in range(count, count + 3):  # the log goes on in a fresh head
            await _put(tier, i)
        await asyncio.wait_for(tier.flush(), 10)
    finally:
        devices[0].broken = False
        await asyncio.wait_for(tier.close(), 10)
    again = NvmeTier(nvme_config(tmp_path, regions=6))
    await again.open()
    try:
        for i in range(count + 3):
            got = await again.get(key(i))
            assert got is None or bytes(got[1]) == payload_for(i, SIZE), i
        for i in range(count, count + 3):  # after the flush that returned: there
            got = await again.get(key(i))
            assert got is not None and bytes(got[1]) == payload_for(i, SIZE), i
    finally:
        await again.close()
