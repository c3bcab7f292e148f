"""An object the nvme log's reclaim copies forward survives a `kill -9`.

A flushed object, read a few times, sits in the log's oldest region with objects never read that
keep the log over half live (a mostly free log reclaims its emptiest region first, not its
oldest); overwrites of another key fill the log until that region is reclaimed, which keeps the
object (copies it into the new head, the reclaimed region itself) rather than dropping it. The
writer is then killed with SIGKILL, no flush in between. The reused region's new header, which
makes its old records stale, used to reach the media alone, the copied entry only with the
head's later writes: after the kill, the flushed object was gone in every run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import tierkv
from tests.engine._configs import MiB, hierarchy_config

ROOT = Path(__file__).resolve().parents[2]

_WRITER = textwrap.dedent("""
    import asyncio, json, sys
    import tierkv
    config = json.loads(sys.argv[1])

    async def main():
        kv = await tierkv.open(config)
        await kv.put(b"A", b"flushed" * 4096)
        for _ in range(3):  # read: worth copying forward (`reinsert_hits`)
            await kv.get(b"A")
        for i in range(100):  # never read: the log over half live, so FIFO takes A's region
            await kv.put(b"C%d" % i, b"c" * 32768)
        await kv.flush()
        for n in range(100_000):
            await kv.put(b"B", b"%d" % n * 4096)
            nvme = kv.stats()["tiers"]["nvme"]
            if nvme["regions_reclaimed"]:
                break
        await asyncio.sleep(0.2)  # the reused region's header is written meanwhile
        nvme = kv.stats()["tiers"]["nvme"]
        print(json.dumps({"located": await kv.locate(b"A"),
                          "reinserted": nvme["entries_reinserted"]}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def _killed_after_its_line(config: dict[str, Any]) -> str:
    """Run the writer on `config`, read the line it prints, then SIGKILL it."""
    with subprocess.Popen([sys.executable, "-c", _WRITER, json.dumps(config)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as writer:
        assert writer.stdout is not None and writer.stderr is not None
        try:
            line = writer.stdout.readline()
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(30)
        assert line, writer.stderr.read()
    return line


async def test_an_object_a_reclaim_kept_survives_a_kill_9(tmp_path: Path) -> None:
    config = hierarchy_config(tmp_path, ("nvme",),
                              nvme={"capacity": 6 * MiB, "region_size": MiB})
    config["scheduler"] = {"policy": "lru"}  # the log's own rule: kept if read twice
    state = json.loads(_killed_after_its_line(config))
    assert state["located"] == "nvme" and state["reinserted"] >= 1  # kept, not dropped
    async with tierkv.open(config) as kv:
        assert await kv.get(b"A") == b"flushed" * 4096
