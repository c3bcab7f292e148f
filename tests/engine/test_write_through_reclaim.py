"""Write-through puts into a log too small for the puts in flight: a reclaim may drop a copy
between its write and the flush a put waits for. The engine used to report that as a
`DeviceError` naming a failed write, with no device failing. Now a reclaim keeps the copies
of puts waiting for their flush as far as it can, a copy dropped all the same is written once
more, and a put that still finds it gone fails with `TierFullError` (the log is too small);
every value read afterwards is one that was put."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config
from tierkv.errors import TierFullError

SIZE = 300 * KiB
CONCURRENT = 24  # 7.2 MiB in flight, into a log of 6 regions of 1 MiB


def value(key: int, round_: int) -> bytes:
    return bytes([key % 251, round_ % 251]) * (SIZE // 2)


async def test_a_copy_reclaimed_before_its_flush_is_not_a_device_error(tmp_path: Path) -> None:
    config = hierarchy_config(tmp_path, ("nvme",), write_policy="write_through",
                              nvme={"capacity": 6 * MiB + 4 * KiB})
    outcome: dict[int, int | None] = {}  # key → the round whose value it holds, None: unknown

    async def put(key: int, round_: int) -> str:
        try:
            await kv.put(f"k{key}", value(key, round_))
        except TierFullError:
            outcome[key] = None  # the old value, or nothing
            return "full"
        outcome[key] = round_
        return "ok"

    async with tierkv.open(config) as kv:
        results: list[str] = []
        for round_ in range(5):
            results += await asyncio.gather(*(put(key, round_) for key in range(CONCURRENT)))
        assert "ok" in results
        assert kv.stats()["engine"]["device_errors"] == 0
        for key, held in outcome.items():
            got = await kv.get(f"k{key}")
            if held is not None and got is not None:
                assert got == value(key, held)
            elif got is not None:
                assert got in [value(key, r) for r in range(5)]


@pytest.mark.parametrize("policy", ["lru", "lru++"])
async def test_the_log_keeps_the_last_durable_copy_of_what_the_first_tier_serves(
        tmp_path: Path, policy: str) -> None:
    """Under `lru` the log's reclaim went by its own rule and dropped the only durable copy of
    objects the gpu tier still served: `unflushed` rose above 0 under write-through, and a
    crash then lost those acknowledged puts."""
    config = hierarchy_config(tmp_path, ("gpu", "nvme"), write_policy="write_through",
                              gpu={"capacity": 2 * MiB, "slot_size": 64 * KiB, "ttl": "1h"},
                              nvme={"capacity": 4 * MiB + 4 * KiB})
    config["scheduler"] = {"policy": policy}
    async with tierkv.open(config) as kv:
        for i in range(80):
            await kv.put(f"k{i}", bytes([i]) * 57_600)
            for j in range(0, i, 7):  # the early keys stay hot in the gpu tier
                await kv.get(f"k{j}")
        await kv.settle()
        assert kv.metrics().unflushed == 0
