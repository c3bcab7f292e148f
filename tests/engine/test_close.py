"""`close` flushes everything to the persistent tiers, also when that needs room made below."""

from __future__ import annotations

import os
from pathlib import Path

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
