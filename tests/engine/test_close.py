"""`close` flushes everything to the persistent tiers, also when that needs room made below;
it is one close however many calls wait for it, and a caller that stops waiting does not stop
it; an engine refuses calls from an event loop other than its own."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import tierkv

pytestmark = pytest.mark.pmem


async def test_close_persists_an_l1_full_of_objects_into_a_full_pool(tmp_path: Path) -> None:
    # L1 holds more than the pool has left: persisting it at close demotes from pmem to nvme
    config = {"tiers": [
        {"name": "gpu", "kind": "gpu", "device": "cpu", "capacity": "4MiB", "slot_size": "64KiB",
         "ttl": "60s"},
        {"name": "pmem", "kind": "pmem", "path": str(tmp_path / "tierkv.pool"),
         "capacity": "8MiB"},
        {"name": "nvme", "kind": "nvme", "path": str(tmp_path / "tierkv.log"),
         "capacity": "64MiB", "region_size": "1MiB"},
    ]}
    values = {f"k{i}": os.urandom(60_000) for i in range(180)}
    async with tierkv.open(config) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        assert kv.stats()["engine"]["unflushed"] > 0
    async with tierkv.open(config) as kv:
        for key, value in values.items():
            assert await kv.get(key) == value, key


def gpu_pmem(tmp: Path, **scheduler: Any) -> dict[str, Any]:
    return {"scheduler": scheduler, "tiers": [
        {"name": "gpu", "kind": "gpu", "device": "cpu", "capacity": "1MiB", "slot_size": "64KiB",
         "ttl": "60s"},
        {"name": "pmem", "kind": "pmem", "path": str(tmp / "tierkv.pool"), "capacity": "8MiB"},
    ]}


async def test_a_close_its_caller_stopped_waiting_for_goes_on_and_later_calls_wait_for_it(
        tmp_path: Path) -> None:
    values = {f"k{i}": os.urandom(60_000) for i in range(12)}
    kv = await tierkv.open(gpu_pmem(tmp_path))
    for key, value in values.items():
        await kv.put(key, value)  # write_back: in the gpu tier only until close flushes them
    first = asyncio.create_task(kv.close())
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await kv.close()  # waits for the close under way: the flush, the tiers closed
    await kv.close()
    async with tierkv.open(gpu_pmem(tmp_path)) as kv:
        for key, value in values.items():
            assert await kv.get(key) == value, key


async def test_concurrent_closes_are_one_close(tmp_path: Path) -> None:
    kv = await tierkv.open(gpu_pmem(tmp_path))
    await kv.put("k", b"v" * 70_000)
    await asyncio.gather(kv.close(), kv.close(), kv.close())
    async with tierkv.open(gpu_pmem(tmp_path)) as kv:  # the pool was released
        assert await kv.get("k") == b"v" * 70_000


async def test_a_backlog_paced_by_the_background_budget_does_not_hold_the_close(
        tmp_path: Path) -> None:
    # 4 KiB/s: the promotions below would take about a minute paced
    kv = await tierkv.open(gpu_pmem(tmp_path, background_bandwidth="4KiB"))
    for i in range(30):
        await kv.put(f"k{i}", os.urandom(60_000))
    await kv.settle()
    below = [f"k{i}" for i in range(30) if await kv.locate(f"k{i}") == "pmem"]
    assert below
    for key in below:
        await kv.get(key)  # a hit below: a promotion, paced
    await asyncio.wait_for(kv.close(), 20)


async def test_demotions_paced_by_the_migration_budget_do_not_hold_the_close(
        tmp_path: Path) -> None:
    # 1 KiB/s for every move: the evictor's demotions out of the full gpu tier held the close
    # about a minute per object, paced (a config of 1 B/s held it for days)
    values = {f"k{i}": os.urandom(60_000) for i in range(16)}
    kv = await tierkv.open(gpu_pmem(tmp_path, migration_bandwidth="1KiB"))
    for key, value in values.items():
        await kv.put(key, value)  # the last fills the tier: demotions are planned, paced
    await asyncio.wait_for(kv.close(), 20)
    async with tierkv.open(gpu_pmem(tmp_path)) as kv:
        for key, value in values.items():
            assert await kv.get(key) == value, key


async def test_an_engine_refuses_calls_from_another_event_loop(tmp_path: Path) -> None:
    async with tierkv.open(gpu_pmem(tmp_path)) as kv:
        errors: list[BaseException] = []

        async def intrude() -> None:
            for call in (kv.put("k", b"x" * 200_000), kv.get("k"), kv.flush(), kv.close()):
                try:
                    await call
                except RuntimeError as exc:
                    errors.append(exc)

        thread = threading.Thread(target=lambda: asyncio.run(intrude()))
        thread.start()
        await asyncio.to_thread(thread.join)
        assert len(errors) == 4
        assert all("event loop" in str(exc) for exc in errors)
        await kv.put("k", b"y" * 200_000)  # the engine's own loop: untouched, working
        assert await kv.get("k") == b"y" * 200_000
        assert kv.stats()["tiers"]["gpu"]["objects"] == 1


async def test_an_opening_is_entered_once(tmp_path: Path) -> None:
    opening = tierkv.open(gpu_pmem(tmp_path))
    async with opening as kv:
        with pytest.raises(RuntimeError, match="entered once"):
            async with opening:
                pass
        await kv.put("k", b"v")


def test_an_opening_is_a_coroutine_another_thread_can_run_on_the_loop(tmp_path: Path) -> None:
    """An application whose loop runs in its own thread opens the engine from outside it;
    `run_coroutine_threadsafe` takes only a coroutine object, and raised `TypeError`."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        opening = tierkv.open(gpu_pmem(tmp_path))
        assert asyncio.iscoroutine(opening)
        kv = asyncio.run_coroutine_threadsafe(opening, loop).result(60)
        asyncio.run_coroutine_threadsafe(kv.put("k", b"v" * 100_000), loop).result(60)
        assert asyncio.run_coroutine_threadsafe(kv.get("k"), loop).result(60) == b"v" * 100_000
        asyncio.run_coroutine_threadsafe(kv.close(), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)
        loop.close()

    async def reopen() -> object:
        kv = await asyncio.create_task(tierkv.open(gpu_pmem(tmp_path)))
        try:
            return await kv.get("k")
        finally:
            await kv.close()

    assert asyncio.run(reopen()) == b"v" * 100_000

    async def closed_first() -> None:
        opening = tierkv.open(gpu_pmem(tmp_path))
        opening.close()  # as a coroutine never started: nothing opened, and it cannot be
        with pytest.raises(RuntimeError, match="reuse"):
            await opening

    asyncio.run(closed_first())


async def test_pins_and_lookups_from_another_event_loop_are_refused(tmp_path: Path) -> None:
    async with tierkv.open(gpu_pmem(tmp_path)) as kv:
        values = {f"k{i}": os.urandom(60_000) for i in range(20)}
        for key, value in values.items():
            await kv.put(key, value)
        await kv.settle()
        placed = {key: await kv.locate(key) for key in values}
        below = next(key for key, tier in placed.items() if tier == "pmem")
        errors: list[BaseException] = []

        async def intrude() -> None:
            try:
                # a pin of an object only in the pool would copy it into the gpu tier
                async with kv.pin(below):
                    pass
            except RuntimeError as exc:
                errors.append(exc)
            for call in (kv.contains(below), kv.locate(below)):
                try:
                    await call
                except RuntimeError as exc:
                    errors.append(exc)

        thread = threading.Thread(target=lambda: asyncio.run(intrude()))
        thread.start()
        await asyncio.to_thread(thread.join)
        assert len(errors) == 3
        assert all("event loop" in str(exc) for exc in errors)
        assert await kv.locate(below) == "pmem"  # nothing was moved from the other thread
        assert kv.stats()["engine"]["pinned"] == 0
        async with kv.pin(below) as handle:  # the engine's own loop
            assert bytes(handle.value.numpy()) == values[below]
