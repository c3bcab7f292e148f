"""A reclaim leaves the room it was for: what it copies forward is padded to a block boundary in
the new head, and the put that needed the room goes in after one reclaim.

The padding was not counted: the kept entries ended up to a block short of the room, the put
rotated again, the same entries went back and forth between two regions, and a put into an
idle, healthy log never ended (cut off at `slow_operation` as a slow device, dropping most of
the log's objects on the way; under load the breaker opened and refused every write)."""

from __future__ import annotations

from pathlib import Path

import pytest

import tierkv

SMALL, COUNT = 3000, 400


@pytest.mark.parametrize("big", [896 * 1024, 900 * 1024, 940_000])
async def test_a_large_put_into_a_log_of_copied_forward_entries_goes_in_at_once(
        tmp_path: Path, big: int) -> None:
    config = {"scheduler": {"policy": "lru"}, "health": {"slow_operation": "5s"},
              "tiers": [{"name": "nvme", "kind": "nvme", "path": str(tmp_path / "l.log"),
                         "capacity": "4MiB", "region_size": "1MiB"}]}
    async with tierkv.open(config) as kv:
        for i in range(COUNT):  # a region and a part: at most half the log live, all kept
            await kv.put(b"s%d" % i, bytes([i % 251]) * SMALL)
        before = kv.stats()["tiers"]["nvme"]["regions_reclaimed"]
        await kv.put(b"big", b"B" * big)
        assert kv.stats()["tiers"]["nvme"]["regions_reclaimed"] - before <= 2
        assert await kv.get(b"big") == b"B" * big
        held = await kv.get_many([b"s%d" % i for i in range(COUNT)])
        assert all(got in (None, bytes([i % 251]) * SMALL) for i, got in enumerate(held))
