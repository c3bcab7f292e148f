"""Reopening in the same process: an open that failed or was cancelled leaves the media free,
so that the next `tierkv.open` of the same config recovers what is stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config
from tierkv import load_config
from tierkv.formats.value import encode_value
from tierkv.keys import PROBE_PREFIX
from tierkv.testing import cancel_at
from tierkv.testing.faults import FaultPlan, open_with_faults
from tierkv.tiers.pmem import PmemTier

pytestmark = pytest.mark.pmem


def _config(directory: Path, kinds: tuple[str, ...]) -> dict[str, Any]:
    return hierarchy_config(directory, kinds, gpu={"capacity": 256 * KiB, "slot_size": 16 * KiB},
                            pmem={"capacity": 16 * MiB}, nvme={"capacity": 16 * MiB})


@pytest.mark.parametrize("kinds", [("gpu", "pmem"), ("gpu", "pmem", "nvme")], ids="-".join)
async def test_an_open_cancelled_at_any_await_leaves_the_media_to_the_next_open(
    tmp_path: Path, kinds: tuple[str, ...]
) -> None:
    """`tierkv.open` cancelled at each of its awaits in turn (a caller's startup timeout):
    every time, a new open of the same config in the same process gets the pool and the log
    (neither is left held by the cancelled one) and serves every stored object."""
    cfg = _config(tmp_path, kinds)
    values = {f"k{i}": bytes([i]) * (3000 + i) for i in range(40)}
    async with tierkv.open(cfg) as kv:
        for key, value in values.items():
            await kv.put(key, value)

    async def reopened(_k: int) -> None:
        async with tierkv.open(cfg) as kv:
            assert await kv.get_many(list(values)) == list(values.values())

    async def open_engine(_k: int) -> tierkv.Engine:
        return await tierkv.open(cfg)

    cancelled, engine = await cancel_at(open_engine, after=reopened)
    await engine.close()
    assert cancelled > 0


async def test_an_open_cancelled_while_it_applies_recorded_tombstones_leaves_the_media(
    tmp_path: Path,
) -> None:
    """The same with a record of refused deletes on media, which an open reads and applies
    after the tiers are open: cancelled there too, the next open gets the media, and the
    deleted object stays deleted."""
    cfg = _config(tmp_path, ("gpu", "pmem", "nvme"))
    plan = FaultPlan()
    kv = await open_with_faults(cfg, plan)
    await kv.put("deleted", b"old value")
    await kv.put("kept", b"kept value")
    await kv.flush()
    plan.add("pmem", "eio", rate=1.0, ops=["delete"])
    assert await kv.delete("deleted")
    await kv.close()  # the pool still refuses: the delete is recorded as a tombstone

    async def reopened(_k: int) -> None:
        # the pool still refuses deletes: its close records the tombstone again for the next
        kv = await open_with_faults(cfg, plan)
        try:
            assert await kv.get_many(["deleted", "kept"]) == [None, b"kept value"]
            assert kv.stats()["engine"]["recovered_tombstoned"] == 1
        finally:
            await kv.close()

    async def open_engine(_k: int) -> tierkv.Engine:
        return await tierkv.open(cfg)

    cancelled, engine = await cancel_at(open_engine, after=reopened)
    await engine.close()
    assert cancelled > 0


@pytest.mark.parametrize("kinds", [("gpu", "pmem"), ("gpu", "pmem", "nvme")], ids="-".join)
async def test_a_smaller_pool_at_reopen_moves_its_oldest_objects_out(
    tmp_path: Path, kinds: tuple[str, ...]
) -> None:
    """The pool reopened with half its capacity holds more than that: the evictor moves the
    oldest objects out. Into the log below, every flushed object is still served, byte for
    byte (the pool freed them at open before); with no tier below, the newest stay."""
    cfg = _config(tmp_path, kinds)
    values = {f"k{i}": bytes([i]) * 200_000 for i in range(60)}  # 12 MB: most in the pool
    async with tierkv.open(cfg) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        await kv.flush()
    cfg["tiers"][1]["capacity"] = 8 * MiB
    async with tierkv.open(cfg) as kv:
        await kv.settle()
        pool = kv.stats()["tiers"]["pmem"]
        assert pool["used"] <= pool["capacity"]
        got = await kv.get_many(list(values))
        if "nvme" in kinds:
            assert got == list(values.values())
        else:
            assert got[-1] == values["k59"] and got[0] is None


async def test_a_leftover_profile_probe_object_is_deleted_at_open(tmp_path: Path) -> None:
    """A process killed between the profile probe's write and its delete leaves the probe's
    object in the pool: the next open deletes it instead of indexing it (it took space and
    counted as an object for good)."""
    cfg = _config(tmp_path, ("gpu", "pmem"))
    async with tierkv.open(cfg) as kv:
        await kv.put("k", b"v")
    pool = PmemTier(load_config(cfg).tiers[1])  # type: ignore[arg-type]
    await pool.open()
    meta, payload = encode_value(b"p" * 4096)
    await pool.put(PROBE_PREFIX + b"4096", meta, payload)
    await pool.close()
    async with tierkv.open(cfg) as kv:
        assert kv.stats()["engine"]["objects"] == 1
        assert kv.stats()["tiers"]["pmem"]["objects"] == 1
        assert await kv.get("k") == b"v"


@pytest.mark.parametrize("kinds", [("nvme",), ("gpu", "nvme")], ids="-".join)
async def test_restarts_that_write_little_lose_nothing_from_a_mostly_free_log(
        tmp_path: Path, kinds: tuple[str, ...]) -> None:
    """Each session's first write into the log opened a new region (the last session's head
    was sealed in place at close): with a little written per session the log wrapped round,
    and its reclaims dropped every cold object while 3 MB of its 15 were live (60 of 60 gone
    after 13 restarts, until session 25's rule that a mostly free log copies everything
    forward, `tests/engine/test_reclaim_room.py`). A session now appends to the last one's head
    (`tierkv.tiers.nvme._resume`): writing a little per session wraps nothing round."""
    cfg = hierarchy_config(tmp_path, kinds, write_policy="write_through",
                           nvme={"capacity": 16 * MiB, "region_size": MiB},
                           gpu={"capacity": 256 * KiB, "slot_size": 64 * KiB})

    def value(i: int) -> bytes:
        return bytes([i]) * 50_000

    async with tierkv.open(cfg) as kv:
        for i in range(60):
            await kv.put(f"obj{i}", value(i))
    for session in range(20):
        async with tierkv.open(cfg) as kv:
            await kv.put("tick", b"%d" % session)
            assert kv.stats()["tiers"]["nvme"]["regions_reclaimed"] == 0
    async with tierkv.open(cfg) as kv:
        await kv.put("tick", b"last")
        assert kv.stats()["tiers"]["nvme"]["regions_reclaimed"] == 0
        assert await kv.get_many([f"obj{i}" for i in range(60)]) == [value(i) for i in range(60)]


async def test_the_recovered_count_is_of_the_objects_found(tmp_path: Path) -> None:
    """`recovered` counts the objects a reopen found and indexed, per tier: not the engine's
    own records (an empty cache reopened counted one object in each persistent tier)."""
    cfg = _config(tmp_path, ("gpu", "pmem", "nvme"))
    async with tierkv.open(cfg):
        pass
    async with tierkv.open(cfg) as kv:
        assert kv.metrics().objects == 0
        assert dict(kv.stats()["engine"]["recovered"]) in ({}, {"pmem": 0, "nvme": 0})
        for i in range(5):
            await kv.put(f"k{i}", b"v" * 100)
    async with tierkv.open(cfg) as kv:
        assert sum(kv.stats()["engine"]["recovered"].values()) == 5 == kv.metrics().objects
