"""A `flush()` holds across later reads and the log's reclaims (write-back, the default
`scheduler.exclusive = false`): a read that promotes a flushed object out of the pmem pool into
the first tier keeps the pool's copy, and the nvme log reclaiming the region of a flushed object
that the first tier holds copies it forward, so a `kill -9` after them loses nothing the flush
covered (README, durability: with `exclusive = true` a promoted object is volatile until the
next flush). Nor does a drop out of the pool undo a flush or a write-through put while the
first tier holds the object too (the whole object leaves), nor does a write-through overwrite
let the old value's copy in the log come back. Byte-for-byte checks after the reopen, with a
real SIGKILL of a child process."""

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

#: the children's start: 40 objects put and flushed
_FILLED = """
import asyncio, json, sys
import tierkv

def value(i):
    return bytes([i]) * (20_000 + i)

async def main(cfg):
    kv = await tierkv.open(cfg)
    for i in range(40):
        await kv.put(f"k{i}", value(i))
    await kv.flush()
"""

_CHILD = _FILLED + """    for i in range(34, 40):  # room on top: the promotions need no eviction
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


_DROPPING_CHILD = """
import asyncio, json, os, sys
import tierkv

async def main(cfg):
    kv = await tierkv.open(cfg)
    orphans = [tierkv.block_keys(list(range(8)), block_size=4, model="m@%d" % i,
                                rope_theta=1e4)
               for i in range(4)]
    for i, (root, block) in enumerate(orphans):  # block 1 of a chain whose block 0 is not stored
        await kv.put(block, bytes([i]) * 65_000, parents=[root])
    if cfg["engine"]["write_policy"] == "write_back":
        await kv.flush()  # the barrier the orphans' later eviction must not undo
    for i in range(160):  # fill the pool: its evictor takes the orphans first
        await kv.put(f"f{i}", bytes([i]) * 65_000)
    if cfg["engine"]["write_policy"] == "write_back":
        await kv.flush()  # the fillers into the pool
    await kv.settle()
    held = [i for i, (_, block) in enumerate(orphans) if await kv.contains(block)]
    held_fillers = [i for i in range(160) if await kv.contains(f"f{i}")]
    print("READ", json.dumps({"orphans": held, "fillers": held_fillers,
                              "evicted": kv.stats()["engine"]["evictions"].get("pmem", 0)}),
          flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


@pytest.mark.pmem
@pytest.mark.crash
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_a_drop_out_of_the_last_tier_on_media_takes_the_copies_above_it(
        tmp_path: Path, policy: str) -> None:
    """The pool drops objects no tier below admits (orphan chain blocks) while the first tier
    holds them too: the whole object leaves the cache. It dropped the pool's copy only, and
    the first tier went on serving an object whose put was acknowledged (or flushed) and
    that a `kill -9` then lost. An object served before the crash is there after it."""
    cfg = hierarchy_config(tmp_path, ("gpu", "pmem", "nvme"), write_policy=policy,
                           gpu={"capacity": 32 * MiB, "slot_size": 64 * KiB, "ttl": "600s"},
                           pmem={"capacity": 8 * MiB}, nvme={"capacity": 64 * MiB})
    reported = run_child_until_read(cfg, _DROPPING_CHILD)
    assert reported["evicted"] > 0 and reported["fillers"]  # the pool evicted; most stayed
    async with tierkv.open(cfg) as reopened:
        for i in range(4):
            block = tierkv.block_keys(list(range(8)), block_size=4, model=f"m@{i}",
                                      rope_theta=1e4)[1]
            if i in reported["orphans"]:  # served before the crash: still there after it
                assert await reopened.get(block) == bytes([i]) * 65_000, i
        for i in reported["fillers"]:
            assert await reopened.get(f"f{i}") == bytes([i]) * 65_000, i


_OVERWRITING_CHILD = """
import asyncio, json, os, sys
import tierkv

async def main(cfg):
    kv = await tierkv.open(cfg)
    await kv.put("k", b"v1" * 30_000)
    fillers = 0
    while await kv.locate("k") != "nvme":  # pushed down into the log by newer objects
        await kv.put(f"f{fillers}", os.urandom(60_000))
        fillers += 1
        if fillers % 32 == 0:
            await kv.settle()
    await kv.put("k", b"v2" * 30_000)  # acknowledged: on media in the pool
    assert await kv.delete("k")
    print("READ", json.dumps({"fillers": fillers}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


async def test_a_write_through_overwrite_keeps_the_old_value_from_coming_back(
        tmp_path: Path) -> None:
    """Write-through, the old value in the log: an overwrite's acknowledgement covers the log's
    tombstone of the old value too. It synced only the pool, which took the new value; the new
    value deleted and the process killed, the log's unsynced head lost the tombstone and the
    reopen served the old value."""
    cfg = hierarchy_config(tmp_path, ("gpu", "pmem", "nvme"), write_policy="write_through",
                           gpu={"capacity": 1 * MiB, "slot_size": 64 * KiB, "ttl": "600s"},
                           pmem={"capacity": 8 * MiB}, nvme={"capacity": 64 * MiB})
    assert run_child_until_read(cfg, _OVERWRITING_CHILD)["fillers"] > 0
    async with tierkv.open(cfg) as reopened:
        assert await reopened.get("k") in (None, b"v2" * 30_000)  # never v1


_EXCLUSIVE_CHILD = _FILLED + """    for i in range(30, 40):  # room on top for the promotions
        assert await kv.delete(f"k{i}")
    await kv.settle()
    below = [i for i in range(30) if await kv.locate(f"k{i}") == "pmem"]
    for i in below:  # hits below: exclusive promotions, queued behind a slow budget
        assert await kv.get(f"k{i}") == value(i)
    await kv.flush()  # every object put before it is durable when it returns...
    await asyncio.sleep(1.5)  # ...and stays so while the promotions asked for before it end
    stats = kv.stats()["engine"]
    print("READ", json.dumps({"promotions": stats["promotions"], "below": len(below)}),
          flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(json.loads(sys.argv[1])))
"""


@pytest.mark.pmem
async def test_an_exclusive_promotion_asked_for_before_a_flush_keeps_its_source(
        tmp_path: Path) -> None:
    """With `exclusive = true` a promotion that a hit asked for before a `flush()` and that
    ended during or after it dropped the pool's copy: the flush had found the object durable,
    and 65 to 86 of 100 objects read before it were gone after a `kill -9` right after it."""
    cfg = hierarchy_config(tmp_path, ("gpu", "pmem"), gpu={"capacity": 384 * KiB,
                                                           "slot_size": 32 * KiB, "ttl": "60s"})
    cfg["scheduler"] = {"exclusive": True, "policy": "lru", "background_bandwidth": "200KiB"}
    reported = run_child_until_read(cfg, _EXCLUSIVE_CHILD)
    assert reported["below"] >= 4 and reported["promotions"].get("gpu", 0) >= 4
    async with tierkv.open(cfg) as reopened:
        for i in range(40):
            expected = None if i >= 30 else bytes([i]) * (20_000 + i)
            assert await reopened.get(f"k{i}") == expected, i
