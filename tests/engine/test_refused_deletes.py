"""Deletes a failing device refused (issue 13): the object never comes back.

A persistent tier that fails a delete keeps the copy on its media; the engine retries the
delete at each flush and records what is still refused as tombstones in a tier that takes
them, so that a reopen — after a clean close or a `kill -9` — never serves the deleted,
invalidated or overwritten value, and never loses a newer one. Faults are injected with
`tierkv.testing.faults` (real `DeviceError`s from the tier's calls); every reopen is a plain
`tierkv.open` with no faults.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import tierkv
from tests.engine._configs import MiB
from tests.engine.test_fault_guarantees import MARGIN, SLOW, config, faulty_engine, value
from tests.tiers.test_pmem_conformance import flip_payload_byte
from tierkv.errors import DeviceError
from tierkv.keys import TOMBSTONES_KEY
from tierkv.testing.faults import FaultPlan, open_with_faults

pytestmark = pytest.mark.pmem


def counters(kv: tierkv.Engine) -> dict[str, Any]:
    engine: dict[str, Any] = kv.stats()["engine"]
    return engine


def counters_of_tier(kv: tierkv.Engine, name: str) -> dict[str, Any]:
    tier: dict[str, Any] = kv.stats()["tiers"][name]
    return tier


async def test_a_delete_the_device_refused_does_not_come_back(tmp_path: Path) -> None:
    cfg = config(tmp_path, ("pmem", "nvme"))
    plan = FaultPlan()
    kv = await open_with_faults(cfg, plan)
    await kv.put("k", b"old")
    await kv.put("other", b"kept")
    await kv.flush()
    plan.add("pmem", "eio", rate=1.0, ops=["delete"])
    assert await kv.delete("k")
    assert await kv.get("k") is None
    await kv.flush()
    assert counters(kv)["deletes_refused"] == 1
    await kv.close()  # the device still refuses: the close's flush cannot delete it either
    async with tierkv.open(cfg) as reopened:
        assert await reopened.get("k") is None
        assert await reopened.get("other") == b"kept"
        assert counters(reopened)["recovered_tombstoned"] == 1


async def test_a_refused_delete_stays_deleted_when_a_copy_of_its_record_rots(
        tmp_path: Path) -> None:
    """The record of refused deletes is kept in both persistent tiers: bit rot in the copy in
    the pool (the refusing device) leaves the copy in the log to keep the object deleted. With
    one copy, the pool dropped the damaged record at open and the deleted value came back."""
    cfg = config(tmp_path, ("pmem", "nvme"))
    plan = FaultPlan()
    kv = await open_with_faults(cfg, plan)
    await kv.put("k", b"old value")
    await kv.flush()
    plan.add("pmem", "eio", rate=1.0, ops=["delete"])
    assert await kv.delete("k")
    await kv.close()
    pool = Path(next(t["path"] for t in cfg["tiers"] if t["kind"] == "pmem"))
    flip_payload_byte(pool, TOMBSTONES_KEY)
    async with tierkv.open(cfg) as reopened:
        assert await reopened.get("k") is None
        assert counters(reopened)["recovered_tombstoned"] == 1


async def test_an_invalidation_the_device_refused_does_not_come_back(tmp_path: Path) -> None:
    cfg = config(tmp_path, ("pmem", "nvme"))
    plan = FaultPlan()
    async with faulty_engine(cfg, plan) as kv:
        await kv.put("parent", b"p")
        await kv.put("child", b"c", parents=["parent"])
        await kv.put("grandchild", b"g", parents=["child"])
        await kv.flush()
        plan.add("pmem", "eio", rate=1.0, ops=["delete"])
        assert await kv.invalidate("parent") == 3
        await kv.flush()
    async with tierkv.open(cfg) as reopened:
        for key in ("parent", "child", "grandchild"):
            assert await reopened.get(key) is None, key


async def test_a_newer_value_outlives_the_tombstone_of_the_older(tmp_path: Path) -> None:
    """The overwritten value's copy stays in the refusing pmem pool; the new one lands in the
    nvme log (pmem refuses puts too) with the tombstone: the reopen serves the new value."""
    cfg = config(tmp_path, ("pmem", "nvme"))
    plan = FaultPlan()
    old, new = value("k", 1, 3000), value("k", 2, 3000)
    async with faulty_engine(cfg, plan) as kv:
        await kv.put("k", old)
        await kv.flush()
        plan.add("pmem", "eio", rate=1.0, ops=["delete", "put"])
        await kv.put("k", new)
        assert await kv.locate("k") == "nvme"
        await kv.flush()
    async with tierkv.open(cfg) as reopened:
        assert await reopened.get("k") == new


async def test_a_refused_delete_is_made_once_the_device_heals(tmp_path: Path) -> None:
    cfg = config(tmp_path, ("pmem", "nvme"))
    plan = FaultPlan()
    async with faulty_engine(cfg, plan) as kv:
        await kv.put("k", b"old")
        await kv.flush()
        plan.add("pmem", "eio", rate=1.0, ops=["delete"])
        await kv.delete("k")
        await kv.flush()
        plan.enabled = False
        await kv.flush()
        assert counters(kv)["deletes_retried"] == 1
    async with tierkv.open(cfg) as reopened:
        assert await reopened.get("k") is None
        assert counters(reopened)["recovered_tombstoned"] == 0  # nothing left to remove


async def test_a_refused_delete_is_made_in_the_background_once_the_device_heals(
        tmp_path: Path) -> None:
    """With no flush: the health watch retries the pending delete (every second), so an engine
    that never flushes gets the copy's space back once the device takes deletes again."""
    cfg = config(tmp_path, ("pmem", "nvme"))
    plan = FaultPlan()
    async with faulty_engine(cfg, plan) as kv:
        await kv.put("k", os.urandom(100_000))
        await kv.flush()
        held = counters_of_tier(kv, "pmem")["used"]
        plan.add("pmem", "eio", rate=1.0, ops=["delete"])
        await kv.delete("k")
        assert counters(kv)["deletes_refused"] == 1
        assert counters_of_tier(kv, "pmem")["used"] == held  # its copy stays on the media
        plan.enabled = False
        for _ in range(100):  # the health watch's next look, within a few of its seconds
            if counters(kv)["deletes_retried"]:
                break
            await asyncio.sleep(0.05)
        assert counters(kv)["deletes_retried"] == 1
        assert counters_of_tier(kv, "pmem")["used"] < held
    async with tierkv.open(cfg) as reopened:
        assert await reopened.get("k") is None


async def test_flush_raises_when_a_refused_delete_cannot_be_recorded(tmp_path: Path) -> None:
    cfg = config(tmp_path, ("pmem",))
    plan = FaultPlan()
    async with faulty_engine(cfg, plan) as kv:
        await kv.put("k", b"old")
        await kv.flush()
        plan.add("pmem", "eio", rate=1.0, ops=["delete", "put"])
        await kv.delete("k")
        with pytest.raises(DeviceError, match="could not be recorded"):
            await kv.flush()
        plan.enabled = False
        await kv.flush()  # healed: the delete is made, the barrier holds again


_CHILD = """
import asyncio, json, sys
import tierkv
from tierkv.testing.faults import FaultPlan, open_with_faults

async def main(cfg):
    plan = FaultPlan()
    plan.enabled = False
    kv = await open_with_faults(cfg, plan)
    plan.enabled = True
    for i in range(40):
        await kv.put(f"k{i}", bytes([i]) * 5000)
    await kv.flush()
    plan.add("pmem", "eio", rate=1.0, ops=["delete"])
    for i in range(0, 40, 2):
        assert await kv.delete(f"k{i}")
    await kv.invalidate("k1")
    await kv.flush()
    print("FLUSHED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


#: the pool fails everything and its breaker is open, so the record of its refused delete lives
#: in the nvme log alone; puts then cycle the log's regions past the record's
_RECLAIM_CHILD = """
import asyncio, json, sys
import tierkv
from tierkv.testing.faults import FaultPlan, open_with_faults

async def main(cfg):
    plan = FaultPlan()
    kv = await open_with_faults(cfg, plan)
    await kv.put("k", b"old value")
    await kv.flush()
    plan.add("pmem", "eio", rate=1.0, ops=["get", "put", "delete"])
    for i in range(24):  # failed puts (falling through to the log) open the pool's breaker
        await kv.put(f"opener/{i}", b"x")
    assert kv.stats()["tiers"]["pmem"]["breaker"] == "open"
    assert await kv.delete("k")
    await kv.flush()
    for i in range(64):  # 16 MiB through an 8 MiB log: every region is reclaimed
        await kv.put(f"filler/{i}", bytes([i]) * (256 << 10))
    assert kv.stats()["tiers"]["nvme"]["regions_reclaimed"] >= 8
    print("FLUSHED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


#: two flushes at once: the first one's record of refused deletes is held up on its way into the
#: pool (a slow device, under `slow_operation`); the second, asked for after one more refused
#: delete, records both and returns; then the first's older record lands over it, in both tiers
_RACE_CHILD = """
import asyncio, json, sys
import tierkv
from tierkv.testing.faults import FaultPlan, open_with_faults

async def main(cfg):
    plan = FaultPlan()
    kv = await open_with_faults(cfg, plan)
    for key in ("first", "second", "kept"):
        await kv.put(key, key.encode() * 1000)
    await kv.flush()
    plan.add("pmem", "eio", rate=1.0, ops=["delete"])
    assert await kv.delete("first")
    plan.add("pmem", "latency", schedule=[1], ops=["put"], arg=0.5)
    earlier = asyncio.create_task(kv.flush())
    for _ in range(1000):  # until its record is on its way into the pool
        if plan.fired["pmem:latency"]:
            break
        await asyncio.sleep(0.01)
    assert plan.fired["pmem:latency"] == 1
    assert await kv.delete("second")
    await kv.flush()
    await earlier
    print("FLUSHED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


def run_child_until_flushed(cfg: dict[str, Any], script: str = _CHILD,
                            args: Sequence[str] = ()) -> None:
    """Run `script` (`_CHILD`) on `cfg` (then `args`) until it says its flush returned, then
    `kill -9` it."""
    child = subprocess.Popen([sys.executable, "-c", script, json.dumps(cfg), *args],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "FLUSHED"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


async def test_refused_deletes_stay_deleted_after_kill_9(tmp_path: Path) -> None:
    cfg = config(tmp_path, ("gpu", "pmem", "nvme"))
    run_child_until_flushed(cfg)
    async with tierkv.open(cfg) as reopened:
        for i in range(40):
            got = await reopened.get(f"k{i}")
            if i % 2 == 0 or i == 1:
                assert got is None, i
            else:
                assert got == bytes([i]) * 5000, i


@pytest.mark.parametrize(("policy", "reinsert_hits"), [("lru++", 2), ("lru", 2), ("lru++", 0)])
async def test_a_refused_delete_stays_deleted_after_the_log_reclaims_its_record(
        tmp_path: Path, policy: str, reinsert_hits: int) -> None:
    """A flush recorded the refused delete in the nvme log; the log's reclaims must keep the
    record until a later one replaces it, under either policy, and where copying entries
    forward is off. They valued the engine's records at nothing and dropped it, and after a
    `kill -9` the deleted value came back from the pool."""
    cfg = config(tmp_path, ("pmem", "nvme"),
                 nvme={"capacity": 8 * MiB, "reinsert_hits": reinsert_hits})
    cfg["scheduler"] = {"policy": policy}
    cfg["health"]["cooldown"] = "1h"  # the pool's breaker stays open: no put tries it again
    run_child_until_flushed(cfg, _RECLAIM_CHILD)
    async with tierkv.open(cfg) as reopened:
        assert await reopened.get("k") is None
        assert counters(reopened)["recovered_tombstoned"] == 1


async def test_concurrent_flushes_never_leave_an_older_record_of_refused_deletes(
        tmp_path: Path) -> None:
    """A flush that starts while another runs waits for it and runs once more: two at once
    wrote the record of refused deletes side by side, and the earlier one's (without the later
    refused delete) landed last in both tiers, after the later flush had returned; after a
    `kill -9` the deleted value came back."""
    cfg = config(tmp_path, ("pmem", "nvme"))
    cfg["health"]["slow_operation"] = "10s"  # the slow put of the record is not cut off
    run_child_until_flushed(cfg, _RACE_CHILD)
    async with tierkv.open(cfg) as reopened:
        assert await reopened.get("first") is None
        assert await reopened.get("second") is None
        assert await reopened.get("kept") == b"kept" * 1000


async def test_a_hung_delete_is_cut_off_and_still_never_comes_back(tmp_path: Path) -> None:
    """A pmem pool whose deletes never answer: each delete returns within `slow_operation`
    and a margin (cut off, recorded as refused); a reopen does not bring the objects back."""
    cfg = config(tmp_path, ("pmem", "nvme"))
    plan = FaultPlan()
    kv = await open_with_faults(cfg, plan)
    for i in range(3):
        await kv.put(f"k{i}", value(f"k{i}", 0, 2000))
    await kv.flush()
    plan.add("pmem", "hang", rate=1.0, ops=["delete"])
    loop = asyncio.get_running_loop()
    for i in range(3):
        started = loop.time()
        assert await kv.delete(f"k{i}")
        assert loop.time() - started < SLOW + MARGIN
    await kv.flush()
    assert counters(kv)["deletes_refused"] == 3
    await kv.close()
    async with tierkv.open(cfg) as reopened:
        for i in range(3):
            assert await reopened.get(f"k{i}") is None, i


async def test_an_older_copy_the_device_refuses_to_delete_at_open_does_not_fail_it(
        tmp_path: Path) -> None:
    """At open, the older of two copies of a key is deleted; a pool that refuses that delete
    does not make the open fail: the newer value is served, and after another reopen too."""
    cfg = config(tmp_path, ("pmem", "nvme"))
    old, new = value("k", 1, 3000), value("k", 2, 3000)
    plan = FaultPlan()
    kv = await open_with_faults(cfg, plan)
    await kv.put("k", old)
    await kv.flush()
    plan.add("pmem", "eio", rate=1.0, ops=["delete", "put"])
    await kv.put("k", new)  # the old copy stays in the pool, the new one goes to the log
    assert await kv.locate("k") == "nvme"
    await kv.close()
    reopened = await open_with_faults(cfg, plan)  # the pool still refuses, during open too
    try:
        assert await reopened.get("k") == new
    finally:
        await reopened.close()
    async with tierkv.open(cfg) as healed:
        assert await healed.get("k") == new
