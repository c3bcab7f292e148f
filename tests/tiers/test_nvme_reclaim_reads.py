"""A read of an entry that a region reclaim is copying forward (a hot entry) finds it.

The reclaim takes the victim region's keys out of the log's index, awaits the region's
pending writes and readers, then places the hot entries in the new head. A lock-free get in
between found nothing: the engine took the miss for a lost copy and forgot it (counted as a
corrupt read), and the entry, placed again, stayed on media listed by no engine entry, so a
later delete missed it and a restart brought the value back. The await is widened here by a
sleep after the region's writes settle, the window every reclaim has."""

from __future__ import annotations

import asyncio
import contextlib
import math
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


async def test_a_put_cancelled_while_its_reclaim_copies_forward_loses_no_kept_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The put whose reclaim is copying forward an entry its owner must not lose (worth
    infinitely much: a flushed object's last durable copy) is cancelled in the window, as the
    engine's cut-off cancels a slow write: the entry is placed all the same, and survives a
    reopen. It was dropped with the cancellation, and the flush that covered it undone."""
    tier = NvmeTier(nvme_config(tmp_path, regions=4, reinsert_hits=0))
    in_window = asyncio.Event()

    async def slow_settle(tasks: Set[asyncio.Task[None]]) -> None:
        await settle(tasks)
        if tier.stats()["regions_reclaimed"] and not in_window.is_set():
            in_window.set()  # the first reclaim has freed its victim (the oldest region)
            await asyncio.sleep(0.2)

    monkeypatch.setattr(_log, "settle", slow_settle)
    kept = payload_for(0, 200_000)
    await tier.open()
    try:
        tier.set_reclaim_worth(lambda k: math.inf if k == key(0) else None)
        await tier.put(key(0), meta_of(kept), memoryview(kept))
        await tier.flush()
        for i in range(1, 60):
            filler = payload_for(i, 150_000)
            put = asyncio.create_task(tier.put(key(i), meta_of(filler), memoryview(filler)))
            window = asyncio.create_task(in_window.wait())
            await asyncio.wait({put, window}, return_when=asyncio.FIRST_COMPLETED)
            window.cancel()
            if not put.done():
                put.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await put
                break
            await put
        assert in_window.is_set()
        got = await tier.get(key(0))
        assert got is not None and bytes(got[1]) == kept
        await tier.flush()
    finally:
        await tier.close()
    again = NvmeTier(nvme_config(tmp_path, regions=4, reinsert_hits=0))
    await again.open()
    try:
        got = await again.get(key(0))
        assert got is not None and bytes(got[1]) == kept
    finally:
        await again.close()
