"""A delete of a key the nvme log's reclaim has just dropped is on media when it returns
(`write_through`), like any delete: the reclaimed region's old records stay on media until its
new header is written, in the background, and until session 25 the engine, which no longer
held the key, told the log nothing: a `kill -9` right after the delete brought the deleted
value back. The log now tombstones such a key, and the delete syncs it.

The writer slows every device write (a `latency` fault), starts a put that makes the log
reclaim its oldest region, deletes a key that reclaim dropped while the put is in flight, and
is killed as the delete returns.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import MiB, hierarchy_config

ROOT = Path(__file__).resolve().parents[2]

_DELETE_IN_THE_WINDOW = textwrap.dedent("""
    import asyncio, json, sys, time
    from tierkv.testing.faults import FaultPlan, open_with_faults
    config = json.loads(sys.argv[1])

    async def main():
        plan = FaultPlan()
        kv = await open_with_faults(config, plan)
        i = 0
        while kv.stats()["tiers"]["nvme"]["regions_reclaimed"] == 0:  # the log has wrapped
            i += 1
            await kv.put(f"k{i}", bytes([i % 256]) * 200_000)
        plan.add("nvme", "latency", rate=1.0, ops=["put"], arg=0.3)  # every device write
        held = {f"k{j}" for j in range(1, i + 1) if await kv.contains(f"k{j}")}
        for n in range(20):  # puts until one reclaims a region while it is in flight
            put = asyncio.ensure_future(kv.put(f"next{n}", bytes(200_000)))
            while not put.done():
                await asyncio.sleep(0.001)
                dropped = [key for key in sorted(held) if not await kv.contains(key)]
                if dropped:
                    await kv.delete(dropped[0])
                    print("DELETED", dropped[0], flush=True)
                    time.sleep(300)  # killed here
            await put
        print("NO_DROP", flush=True)

    asyncio.run(main())
""")


@pytest.mark.crash
def test_a_key_the_logs_reclaim_just_dropped_stays_deleted_after_kill_9(tmp_path: Path) -> None:
    cfg = hierarchy_config(tmp_path, ("nvme",), write_policy="write_through",
                           nvme={"capacity": 8 * MiB, "region_size": MiB})
    cfg["health"] = {"slow_operation": "60s"}
    with subprocess.Popen([sys.executable, "-c", _DELETE_IN_THE_WINDOW, json.dumps(cfg)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as writer:
        try:
            assert writer.stdout is not None
            word, victim = [*writer.stdout.readline().split(), ""][:2]
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(30)
    assert word == "DELETED"

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            assert await kv.get(victim) is None

    asyncio.run(reopen())
