"""A stall of the event loop itself is not a slow device: reads and writes in flight while the
loop is held up for longer than `slow_operation` (a long synchronous call in the application, a
process descheduled on a busy machine) are neither cut off into misses nor counted against the
tiers' circuit breakers (`tierkv._deadline`). A fault soak on a loaded CI machine once counted
32 objects on media as lost this way, every read of its final `get_many` then in flight."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config
from tierkv.testing.faults import FaultPlan, open_with_faults

pytestmark = pytest.mark.pmem

STALL = 0.4  # longer than the config's slow_operation


def _config(directory: Path) -> dict[str, object]:
    config = hierarchy_config(directory, ("gpu", "pmem", "nvme"),
                              gpu={"capacity": MiB, "slot_size": 16 * KiB},
                              pmem={"free_low": 0.85, "free_high": 0.9},
                              nvme={"capacity": 64 * MiB})
    config["health"] = {"slow_operation": "250ms", "cooldown": "1s"}
    return config


def _failures(kv: tierkv.Engine) -> dict[str, int]:
    return {name: tier["breaker_failures"] for name, tier in kv.stats()["tiers"].items()}


async def test_a_stalled_loop_cuts_off_no_read_in_flight(tmp_path: Path) -> None:
    config = _config(tmp_path)
    rng = random.Random(0)
    keys = [f"k/{i}".encode() for i in range(256)]
    values = {key: rng.randbytes(rng.randrange(64, 64 * KiB)) for key in keys}
    async with tierkv.open(config) as kv:
        for key in keys:
            await kv.put(key, values[key])
    async with tierkv.open(config) as kv:  # everything is in the pool and the log now
        assert {await kv.locate(key) for key in keys} == {"pmem", "nvme"}
        asyncio.get_running_loop().call_later(0.005, time.sleep, STALL)
        got = await kv.get_many(keys)
        missed = [key for key, value in zip(keys, got, strict=True) if value != values[key]]
        assert not missed, f"{len(missed)} of {len(keys)} reads missed"
        assert _failures(kv) == {"gpu": 0, "pmem": 0, "nvme": 0}


async def test_a_stalled_loop_cuts_off_no_write_in_flight(tmp_path: Path,
                                                          request: pytest.FixtureRequest) -> None:
    # large puts into the pool run on its copy threads, so they are in flight during the stall
    # the pool on tmpfs: on a disk file each put's msync alone may take longer than 100 ms
    pool = Path("/dev/shm") / f"tierkv-test-{uuid.uuid4().hex}.pool"
    request.addfinalizer(lambda: pool.unlink(missing_ok=True))
    config = hierarchy_config(tmp_path, ("pmem", "nvme"),
                              pmem={"capacity": 32 * MiB, "path": str(pool)})
    config["health"] = {"slow_operation": "250ms", "cooldown": "1s"}
    rng = random.Random(1)
    values = {f"w/{i}".encode(): rng.randbytes(256 * KiB) for i in range(48)}
    async with tierkv.open(config) as kv:
        asyncio.get_running_loop().call_later(0.002, time.sleep, STALL)
        await asyncio.gather(*(kv.put(key, value) for key, value in values.items()))
        assert {await kv.locate(key) for key in values} == {"pmem"}  # none fell through
        assert _failures(kv) == {"pmem": 0, "nvme": 0}
    async with tierkv.open(config) as kv:
        assert await kv.get_many(list(values)) == list(values.values())


async def test_a_stall_during_a_probe_does_not_open_a_healing_breaker_again(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The pool's breaker opened on failed reads, the device healed, the breaker is half-open;
    its probe, a read, is in flight when the loop stalls past `slow_operation`, and the first
    call after the stall asks the breaker before the probe's answer is taken in. The breaker's
    clock must not expire the probe the cut-off gave the stall back to: the read is served and
    counts, and the breaker does not open again for another cool-down."""
    pool = Path("/dev/shm") / f"tierkv-test-{uuid.uuid4().hex}.pool"
    request.addfinalizer(lambda: pool.unlink(missing_ok=True))
    config = hierarchy_config(tmp_path, ("pmem", "nvme"), pmem={"path": str(pool)})
    config["health"] = {"slow_operation": "250ms", "cooldown": "1s"}
    plan = FaultPlan()
    values = {f"p/{i}".encode(): random.Random(i).randbytes(128 * KiB) for i in range(4)}
    plan.enabled = False
    kv = await open_with_faults(config, plan)
    try:
        for key, value in values.items():  # large: a read of one runs on the pool's threads
            await kv.put(key, value)
        plan.add("pmem", "eio", rate=1.0, ops=("get",))
        plan.enabled = True
        for _ in range(25):
            await kv.get(b"p/0")
        assert kv.stats()["tiers"]["pmem"]["breaker"] == "open"
        plan.enabled = False  # the device heals
        deadline = time.monotonic() + 10
        while kv.stats()["tiers"]["pmem"]["breaker"] != "half_open":
            assert time.monotonic() < deadline, "the breaker never turned half-open"
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        loop.call_soon(time.sleep, 1.3)  # once the probe is in flight
        # then a get asks the breaker first: it finds the probe in flight past its deadline
        after: list[asyncio.Future[object]] = []
        loop.call_soon(lambda: after.append(asyncio.ensure_future(kv.get(b"p/2"))))
        assert await kv.get(b"p/1") == values[b"p/1"]  # the probe
        await after[0]  # skipped the tier (the probe's slot was taken) or served
        assert kv.stats()["tiers"]["pmem"]["breaker"] != "open"
    finally:
        plan.enabled = False
        await kv.close()
