"""An object whose last lasting copy the nvme log drops for room leaves the cache.

The log's reclaim keeps the last lasting copy of an object a volatile tier holds as long as
the room it reclaims for allows; beyond that it drops it, and the engine kept serving the
object from the gpu tier alone. A crash then lost an object a flush had covered, and with more
in the gpu tier than the log can hold every flush wrote the same objects again, each time
dropping others, and raised `DeviceError` naming no failed device, for good: `close()` too. A
drop out of the pool (the last tier dropping by policy) already took the object's volatile
copies with it; the log's drop for room now does the same, while a copy the log drops because
it failed (a failed write, a failed checksum) leaves the good copies above it in place.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config
from tierkv.errors import DeviceError
from tierkv.testing.faults import FaultPlan, open_with_faults

SIZE = 64 * KiB
COUNT = 128  # 8 MiB: the whole gpu tier, more than the log's 6 MiB of data regions


def value(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


def config(tmp_path: Path, write_policy: str) -> dict[str, object]:
    return hierarchy_config(tmp_path, ("gpu", "nvme"), write_policy=write_policy,
                            gpu={"capacity": 8 * MiB, "ttl": "1h"},
                            nvme={"capacity": 8 * MiB})


async def test_a_flush_of_more_than_the_log_holds_returns_and_holds(tmp_path: Path) -> None:
    async with tierkv.open(config(tmp_path, "write_back")) as kv:
        for i in range(COUNT):
            await kv.put(f"k{i}", value(i))
        await kv.flush()
        await kv.flush()
        stats = kv.stats()
        assert stats["engine"]["unflushed"] == 0
        assert stats["engine"]["drops"] >= COUNT - 6 * MiB // SIZE
        held = {i for i in range(COUNT) if await kv.get(f"k{i}") is not None}
        assert held and len(held) == stats["engine"]["objects"]
    async with tierkv.open(config(tmp_path, "write_back")) as kv:  # all it held, on media
        for i in range(COUNT):
            got = await kv.get(f"k{i}")
            assert (got is not None) == (i in held), i
            assert got is None or got == value(i), i


async def test_write_through_puts_into_a_log_smaller_than_the_first_tier(
        tmp_path: Path) -> None:
    async with tierkv.open(config(tmp_path, "write_through")) as kv:
        for i in range(COUNT):
            await kv.put(f"k{i}", value(i))
        await kv.settle()
        assert kv.stats()["engine"]["unflushed"] == 0  # nothing served that a crash loses
        held = {i for i in range(COUNT) if await kv.get(f"k{i}") is not None}
        assert held
    async with tierkv.open(config(tmp_path, "write_through")) as kv:
        for i in held:
            assert await kv.get(f"k{i}") == value(i), i


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_a_close_of_more_than_the_log_holds_succeeds(tmp_path: Path,
                                                           write_policy: str) -> None:
    kv = await tierkv.open(config(tmp_path, write_policy))
    for i in range(COUNT):
        await kv.put(f"k{i}", value(i))
    await kv.close()  # raised DeviceError, every time


async def test_copies_a_failed_log_write_dropped_leave_the_gpu_copies_in_place(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)  # the injected failures are logged
    few = 16
    plan = FaultPlan.parse("nvme:torn=1;ops=put", seed=1)
    plan.enabled = False
    kv = await open_with_faults(config(tmp_path, "write_back"), plan)
    try:
        for i in range(few):
            await kv.put(f"k{i}", value(i))
        plan.enabled = True  # every write of the log fails part way, with EIO
        with pytest.raises(DeviceError):
            await kv.flush()
        plan.enabled = False
        for i in range(few):  # not an eviction: still served, and flushed once the log heals
            assert await kv.get(f"k{i}") == value(i), i
        await kv.flush()
    finally:
        plan.enabled = False
        await kv.close()
    async with tierkv.open(config(tmp_path, "write_back")) as kv:
        for i in range(few):
            assert await kv.get(f"k{i}") == value(i), i
