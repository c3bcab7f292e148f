"""A read of an entry that a region reclaim is copying forward (a hot entry) finds it.

The reclaim takes the victim region's keys out of the log's index, awaits the region's
pending writes and readers, then places the hot entries in the new head. A lock-free get in
between found nothing: the engine took the miss for a lost copy and forgot it (counted as a
corrupt read), and the entry, placed again, stayed on media listed by no engine entry, so a
later delete missed it and a restart brought the value back. The await is widened here by a
sleep after the region's writes settle, the window every reclaim has."""

from __future__ import annotations

import asyncio
from collections.abc import Set
from pathlib import Path

import pytest

from tests.tiers._nvme_support import key, meta_of, nvme_config, payload_for
from tierkv.tiers.nvme import _log
from tierkv.tiers.nvme._tasks import settle
from tierkv.tiers.nvme.tier import NvmeTier

pytestmark = pytest.mark.uring


async def test_a_hot_entry_being_copied_forward_stays_readable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def slow_settle(tasks: Set[asyncio.Task[None]]) -> None:
        await settle(tasks)
        await asyncio.sleep(0.02)

    monkeypatch.setattr(_log, "settle", slow_settle)
    tier = NvmeTier(nvme_config(tmp_path, regions=4, reinsert_hits=1))
    await tier.open()
    try:
        hot = payload_for(0, 200_000)
        await tier.put(key(0), meta_of(hot), memoryview(hot))
        stop = False
        reads: list[bool] = []

        async def reader() -> None:
            while not stop:
                got = await tier.get(key(0))
                reads.append(got is not None and bytes(got[1]) == hot)
                await asyncio.sleep(0.001)

        task = asyncio.create_task(reader())
        for i in range(1, 40):
            filler = payload_for(i, 150_000)
            await tier.put(key(i), meta_of(filler), memoryview(filler))
        stop = True
        await task
        assert tier.stats()["entries_reinserted"] > 0  # the reclaims did copy it forward
        assert all(reads), f"{reads.count(False)} of {len(reads)} reads missed it"
    finally:
        await tier.close()
