"""A crash in the middle of a cascade (`invalidate`, an overwriting `put`) leaves nothing that
a later write or invalidation of the root cannot reach, and never the new value beside what
derived from the old one.

The writer stalls the pool's n-th delete of the cascade (a `latency` fault: the deletes before
it are made, on media, the rest not) and is killed there with SIGKILL. The cascade removed the
nearest first: after a chain's first link had gone, its rest was on media with no edge from the
root left anywhere, so no later `invalidate` or `put` of the root reached it (all 38 of 40
blocks stayed readable for good), and an overwrite wrote its new value before the cascade
began, so a crash left the new value on media beside what derived from the old one.
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
BLOCKS = 40

_STALLED_CASCADE = textwrap.dedent("""
    import asyncio, json, sys, time
    from tierkv.testing.faults import FaultPlan, open_with_faults
    config, op, blocks = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])

    async def main():
        plan = FaultPlan()
        kv = await open_with_faults(config, plan)
        await kv.put("a", b"old" * 1000)
        parent = "a"
        for i in range(blocks):  # a chain: each block names the one before
            await kv.put(f"k{i}", b"derived %d" % i * 300, parents=[parent])
            parent = f"k{i}"
        await kv.flush()
        # the pool's deletes from here on: the third never answers
        plan.add("pmem", "latency", schedule=[3], ops=["delete"], arg=600.0)
        if op == "invalidate":
            work = asyncio.ensure_future(kv.invalidate("a"))
        else:
            work = asyncio.ensure_future(kv.put("a", b"new" * 1000))
        await asyncio.sleep(0.5)
        print("DONE" if work.done() else "STALLED", flush=True)
        time.sleep(300)  # killed here

    asyncio.run(main())
""")


def _stalled_then_killed(cfg: dict[str, object], op: str) -> str:
    with subprocess.Popen([sys.executable, "-c", _STALLED_CASCADE, json.dumps(cfg), op,
                           str(BLOCKS)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as writer:
        try:
            assert writer.stdout is not None
            return writer.stdout.readline().strip()
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(30)


@pytest.mark.crash
@pytest.mark.parametrize(("kinds", "policy"), [
    (("pmem",), "write_back"), (("pmem",), "write_through"), (("gpu", "pmem"), "write_through"),
], ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("op", ["invalidate", "put"])
def test_a_cascade_cut_by_kill_9_is_finished_by_the_next_write(
        tmp_path: Path, op: str, kinds: tuple[str, ...], policy: str) -> None:
    cfg = hierarchy_config(tmp_path, kinds, write_policy=policy)
    cfg["health"] = {"slow_operation": "60s"}  # the stalled delete is not cut off first
    assert _stalled_then_killed(cfg, op) == "STALLED"
    blocks = [f"k{i}" for i in range(BLOCKS)]

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            root = await kv.get("a")
            kept = [value for value in await kv.get_many(blocks) if value is not None]
            # the deletes made were the farthest blocks', and the new value is not written
            # before what derived from the old one has gone
            assert root == b"old" * 1000 and 0 < len(kept) < BLOCKS
            if op == "invalidate":
                await kv.invalidate("a")  # the caller retries the call that never returned
                assert await kv.get("a") is None
            else:
                await kv.put("a", b"new" * 1000)
                assert await kv.get("a") == b"new" * 1000
            assert await kv.get_many(blocks) == [None] * BLOCKS

    asyncio.run(reopen())
