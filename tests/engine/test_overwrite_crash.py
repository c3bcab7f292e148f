"""A crash during a write-through overwrite leaves the key with its old, acknowledged value or
the new one, never with none: the old value's persistent copies stay on media until the new
value is on media too.

The writer stalls the pool's write of the new value (a `latency` fault) and is killed there
with SIGKILL. The old value's pool copy used to be freed before the new one was written, so
the key was a miss after the restart although its last acknowledged put had returned.
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
from tests.engine._configs import hierarchy_config

ROOT = Path(__file__).resolve().parents[2]
OLD, NEW = b"old" * 5000, b"new" * 5000

_STALLED_OVERWRITE = textwrap.dedent("""
    import asyncio, json, sys, time
    from tierkv.testing.faults import FaultPlan, open_with_faults
    config = json.loads(sys.argv[1])

    async def main():
        plan = FaultPlan()
        kv = await open_with_faults(config, plan)
        await kv.put("k", b"old" * 5000)  # write-through: on media when this returns
        await kv.put("other", b"other" * 100)
        plan.add("pmem", "latency", schedule=[1], ops=["put"], arg=600.0)  # the new value's
        overwrite = asyncio.ensure_future(kv.put("k", b"new" * 5000))
        await asyncio.sleep(0.5)
        print("DONE" if overwrite.done() else "STALLED", flush=True)
        time.sleep(300)  # killed here

    asyncio.run(main())
""")


@pytest.mark.crash
@pytest.mark.parametrize("kinds", [("pmem",), ("gpu", "pmem"), ("pmem", "nvme")], ids="-".join)
def test_a_write_through_overwrite_cut_by_kill_9_keeps_the_old_value(
        tmp_path: Path, kinds: tuple[str, ...]) -> None:
    cfg = hierarchy_config(tmp_path, kinds, write_policy="write_through")
    cfg["health"] = {"slow_operation": "60s"}  # the stalled write is not cut off first
    with subprocess.Popen([sys.executable, "-c", _STALLED_OVERWRITE, json.dumps(cfg)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as writer:
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "STALLED"
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(30)

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            assert await kv.get("k") == OLD  # the new value never reached media
            assert await kv.get("other") == b"other" * 100

    asyncio.run(reopen())


_OVERWRITE_ACROSS_TIERS = textwrap.dedent("""
    import asyncio, json, sys, time
    import tierkv
    config = json.loads(sys.argv[1])

    async def main():
        kv = await tierkv.open(config)
        await kv.put("k", b"L" * (9 << 20))  # more than the 8 MiB pool: into the log
        first = await kv.locate("k")
        await kv.put("k", b"new" * 5000)  # into the pool
        print(first, await kv.locate("k"), flush=True)
        time.sleep(300)  # killed here

    asyncio.run(main())
""")


@pytest.mark.crash
def test_a_write_through_overwrite_deletes_the_old_copy_it_did_not_replace(
        tmp_path: Path) -> None:
    """The old value in the log, the new one in the pool: the log's copy is deleted, synced,
    before the put returns. Left on media, a restart after the new value had left the cache
    would serve the old one."""
    cfg = hierarchy_config(tmp_path, ("pmem", "nvme"), write_policy="write_through",
                           nvme={"capacity": 64 << 20, "region_size": 16 << 20})
    with subprocess.Popen([sys.executable, "-c", _OVERWRITE_ACROSS_TIERS, json.dumps(cfg)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as writer:
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline().split() == ["nvme", "pmem"]
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(30)

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            assert await kv.get("k") == NEW
            assert kv.stats()["engine"]["recovered_superseded"] == 0  # the log had no copy

    asyncio.run(reopen())
