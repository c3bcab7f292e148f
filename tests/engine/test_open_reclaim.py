"""An open writes into the tiers before it serves anything: this session's membership record
(two local persistent tiers), the deletes of superseded copies, the engine's own records. Into
a log a previous session left full, such a write reclaims a region and drops entries. The
engine used to install the log's drop listener only after those writes: it went on listing the
dropped copies, and their first gets counted as corrupt reads and missed. (An open appends to
the newest region where it has room, `tierkv.tiers.nvme._resume`: between the sessions the
log's newest region is filled to its end through the tier, so that the open's first write
rotates.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tierkv
from tests.engine._configs import MiB, hierarchy_config
from tierkv.config import NvmeTierConfig, load_config
from tierkv.formats.value import encode_value
from tierkv.tiers.nvme.tier import NvmeTier

pytestmark = pytest.mark.pmem


async def _fill_the_newest_region(config: dict[str, Any]) -> None:
    """Put one object into the full log that takes what is left of its newest region."""
    [settings] = [t for t in load_config(config).tiers if isinstance(t, NvmeTierConfig)]
    log = NvmeTier(settings)
    await log.open()
    try:
        stats = log.stats()
        assert stats["regions_free"] <= stats["regions_reserved"]  # full: room is the head's
        room = log.room()
        size = max(room - log.footprint(0), 0)
        while size and log.footprint(size) > room:
            size -= 64
        meta, payload = encode_value(b"f" * size)
        await log.put(b"filler", meta, payload)
    finally:
        await log.close()


@pytest.mark.parametrize(("size", "count"), [(184_537, 76), (217_526, 88)])
async def test_copies_a_reclaim_at_open_drops_are_not_listed(tmp_path: Path, size: int,
                                                             count: int) -> None:
    config = hierarchy_config(tmp_path, ("pmem", "nvme"), nvme={"capacity": 6 * MiB})
    values = {f"k{i}": bytes([i % 251]) * size for i in range(count)}
    async with tierkv.open(config) as kv:  # the pool and the log end up full
        for key, value in values.items():
            await kv.put(key, value)
    await _fill_the_newest_region(config)
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
