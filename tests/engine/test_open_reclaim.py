"""An open writes into the tiers before it serves anything: this session's membership record
(two local persistent tiers), the deletes of superseded copies, the engine's own records. Into
a log a previous session left full, such a write reclaims a region and drops entries. The
engine used to install the log's drop listener only after those writes: it went on listing the
dropped copies, and their first gets counted as corrupt reads and missed."""

from __future__ import annotations

from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import MiB, hierarchy_config

pytestmark = pytest.mark.pmem


@pytest.mark.parametrize(("size", "count"), [(184_537, 76), (217_526, 88)])
async def test_copies_a_reclaim_at_open_drops_are_not_listed(tmp_path: Path, size: int,
                                                             count: int) -> None:
    config = hierarchy_config(tmp_path, ("pmem", "nvme"), nvme={"capacity": 6 * MiB})
    values = {f"k{i}": bytes([i % 251]) * size for i in range(count)}
    async with tierkv.open(config) as kv:  # the pool and the log end up full
        for key, value in values.items():
            await kv.put(key, value)
    async with tierkv.open(config) as kv:
        log = kv.stats()["tiers"]["nvme"]
        assert log["regions_reclaimed"] >= 1 and log["entries_dropped"] >= 1, \
            "the open's writes reclaimed nothing: the test lost its point"
        listed = 0
        for key, value in values.items():
            if await kv.contains(key):
                listed += 1
                assert await kv.get(key) == value, key
        assert listed > 0
        assert kv.stats()["engine"]["corrupt_reads"] == 0
