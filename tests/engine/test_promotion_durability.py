"""A `flush()` holds across later reads and the log's reclaims (write-back, the default
`scheduler.exclusive = false`): a read that promotes a flushed object out of the pmem pool into
the first tier keeps the pool's copy, and the nvme log reclaiming the region of a flushed object
that the first tier holds copies it forward, so a `kill -9` after them loses nothing the flush
covered (README, durability: with `exclusive = true` a promoted object is volatile until the
next flush). Byte-for-byte checks after the reopen, with a real SIGKILL of a child process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE

_CHILD = """
import asyncio, json, sys
import tierkv

def value(i):
    return bytes([i]) * (20_000 + i)

async def main(cfg):
    kv = await tierkv.open(cfg)
    for i in range(40):
        await kv.put(f"k{i}", value(i))
    await kv.flush()
    for i in range(34, 40):  # room on top: the promotions need no eviction
        assert await kv.delete(f"k{i}")
    await kv.flush()
    for i in range(4):  # reads of what only the pool holds: each a hit below, promoted
        assert await kv.get(f"k{i}") == value(i)
    await kv.settle()
    assert all([await kv.locate(f"k{i}") == "gpu" for i in range(4)])
    stats = kv.stats()["engine"]
    print("READ", json.dumps({"promotions": stats["promotions"]}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


def run_child_until_read(cfg: dict[str, Any], script: str = _CHILD) -> dict[str, Any]:
    """Run `script` on `cfg` until it reports, then `kill -9` it; what it reported."""
    child = subprocess.Popen([sys.executable, "-c", script, json.dumps(cfg)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert child.stdout is not None
        word, _, report = child.stdout.readline().partition(" ")
        assert word == "READ", word
        reported: dict[str, Any] = json.loads(report)
        return reported
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


@pytest.mark.pmem
async def test_a_flush_holds_across_the_promotions_of_later_reads(tmp_path: Path) -> None:
    cfg = hierarchy_config(tmp_path, ("gpu", "pmem"), gpu={"capacity": 256 * KiB,
                                                           "slot_size": 32 * KiB, "ttl": "60s"})
    reported = run_child_until_read(cfg)
    assert reported["promotions"] == {"gpu": 4}  # the reads did move objects up
    async with tierkv.open(cfg) as reopened:
        for i in range(40):
            expected = None if i >= 34 else bytes([i]) * (20_000 + i)
            assert await reopened.get(f"k{i}") == expected, i


_RECLAIMING_CHILD = """
import asyncio, json, sys
import tierkv

def value(tag, i):
    return (tag.encode() + bytes([i])) * 30_000

async def main(cfg):
    kv = await tierkv.open(cfg)
    for i in range(6):  # the first region's start, held by the first tier all along
        await kv.put(f"a{i}", value("a", i))
    await kv.flush()
    for i in range(26):  # the rest of it and more, dead once deleted
        await kv.put(f"d{i}", value("d", i))
    await kv.flush()
    for i in range(26):
        assert await kv.delete(f"d{i}")
    await kv.flush()
    for i in range(20):  # this flush makes the log reclaim the first region
        await kv.put(f"b{i}", value("b", i))
    await kv.flush()
    stats = kv.stats()
    print("READ", json.dumps({"reclaimed": stats["tiers"]["nvme"]["regions_reclaimed"],
                              "unflushed": stats["engine"]["unflushed"]}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


async def test_a_flush_holds_across_the_logs_reclaim_of_objects_the_first_tier_holds(
        tmp_path: Path) -> None:
    """The first tier holds every object (the log's copies are their only durable ones): a
    reclaim of their region copies them forward instead of dropping them, which would have
    left them volatile with no flush to come (the engine's reclaim filter, `lru++`)."""
    cfg = hierarchy_config(tmp_path, ("gpu", "nvme"), gpu={"capacity": 16 * MiB, "ttl": "60s"},
                           nvme={"capacity": SUPERBLOCK_SIZE + 4 * MiB})
    reported = run_child_until_read(cfg, _RECLAIMING_CHILD)
    assert reported == {"reclaimed": 1, "unflushed": 0}
    async with tierkv.open(cfg) as reopened:
        for tag, count in (("a", 6), ("d", 26), ("b", 20)):
            for i in range(count):
                expected = None if tag == "d" else (tag.encode() + bytes([i])) * 30_000
                assert await reopened.get(f"{tag}{i}") == expected, (tag, i)
