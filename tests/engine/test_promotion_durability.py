"""A `flush()` holds across later reads (write-back, the default `scheduler.exclusive = false`):
a read that promotes a flushed object out of the pmem pool into the first tier keeps the pool's
copy, so a `kill -9` after the reads loses nothing the flush covered (README, durability: with
`exclusive = true` the promoted object is volatile until the next flush). Byte-for-byte check
after the reopen, with a real SIGKILL of a child process."""

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
from tests.engine._configs import KiB, hierarchy_config

pytestmark = pytest.mark.pmem

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


def run_child_until_read(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run `_CHILD` on `cfg` until its reads are done, then `kill -9` it; what it reported."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(cfg)],
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


async def test_a_flush_holds_across_the_promotions_of_later_reads(tmp_path: Path) -> None:
    cfg = hierarchy_config(tmp_path, ("gpu", "pmem"), gpu={"capacity": 256 * KiB,
                                                           "slot_size": 32 * KiB, "ttl": "60s"})
    reported = run_child_until_read(cfg)
    assert reported["promotions"] == {"gpu": 4}  # the reads did move objects up
    async with tierkv.open(cfg) as reopened:
        for i in range(40):
            expected = None if i >= 34 else bytes([i]) * (20_000 + i)
            assert await reopened.get(f"k{i}") == expected, i
