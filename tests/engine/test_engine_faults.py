"""A failing device under the engine: a read error is a miss, nothing else is lost.

The nvme tier's file is truncated under the open engine, so reads of what it held fail in the
kernel's read path (past the end of the file); objects in the other tiers stay served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import tierkv
from tests.engine._configs import hierarchy_config
from tests.engine.test_hierarchy import hierarchy
from tierkv.testing.faults import FaultPlan, open_with_faults


async def test_nvme_read_failure_is_a_counted_miss(tmp_path: Path) -> None:
    config = hierarchy(tmp_path, pmem=False)
    # large objects fill sealed regions on media; small ones stay in L1
    values = {f"big{i}": os.urandom(60_000) for i in range(40)}
    values.update({f"small{i}": os.urandom(3000) for i in range(4)})
    async with tierkv.open(config) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        await kv.flush()
        below = [k for k in values if await kv.locate(k) == "nvme"]
        above = [k for k in values if await kv.locate(k) == "gpu"]
        # L1 keeps free space between its watermarks, so a small object may be below too
        assert below[:40] == [f"big{i}" for i in range(40)] and above
        os.truncate(tmp_path / "tierkv.log", 4096)
        below = below[:20]  # the first regions written are sealed, read from the device
        for key in below:
            assert await kv.get(key) is None
        for key in above:
            assert await kv.get(key) == values[key]
        stats = kv.stats()["engine"]
        # each failed, or was skipped once the failures opened the log's breaker
        assert stats["device_errors"] + stats["breaker_skips"] >= len(below)
        assert stats["misses"] >= len(below)
        await kv.put("after", b"still works")
        assert await kv.get("after") == b"still works"


async def test_corrupt_payload_below_is_a_miss_not_wrong_bytes(tmp_path: Path) -> None:
    config = hierarchy(tmp_path, pmem=False)
    marker = b"\xab\xcd" * 1500
    async with tierkv.open(config) as kv:
        await kv.put("victim", marker)
        for i in range(8):
            await kv.put(f"filler{i}", os.urandom(3000))
        await kv.flush()
        assert await kv.locate("victim") == "nvme"
    raw = bytearray((tmp_path / "tierkv.log").read_bytes())
    at = raw.find(marker)
    assert at > 0
    raw[at + 100] ^= 0xFF
    (tmp_path / "tierkv.log").write_bytes(bytes(raw))
    async with tierkv.open(config) as kv:
        assert await kv.get("victim") is None
        assert await kv.get("filler7") is not None


#: puts into a log whose every device write fails: the file size limit lowered below the first
#: region (writes past it fail with EFBIG in the kernel's write path); prints what the engine
#: reported once the puts ended
_DEAD_LOG_CHILD = """
import asyncio, json, resource, signal, sys
import tierkv

async def main(cfg):
    kv = await tierkv.open(cfg)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    failed = 0
    for i in range(120):
        try:
            await kv.put(f"k{i}", bytes([i]) * 3000)
        except tierkv.DeviceError:
            failed += 1
    stats = kv.stats()
    print(json.dumps({"failed": failed, "device_errors": stats["engine"]["device_errors"],
                      "opened": stats["tiers"]["nvme"]["breaker_opened"]}), flush=True)

asyncio.run(main(json.loads(sys.argv[1])))
"""


def test_a_log_whose_every_write_fails_opens_its_breaker(tmp_path: Path) -> None:
    """A put into the log appends to its buffer in memory: only the flush meets the device.
    Counted as successes, the appends outnumbered the failed flushes, the breaker never
    opened and `device_errors` stayed 0, so every write_through put went on into the dead
    log."""
    config = hierarchy(tmp_path, pmem=False, write_policy="write_through")
    config["health"] = {"cooldown": "1h"}
    child = subprocess.run([sys.executable, "-c", _DEAD_LOG_CHILD, json.dumps(config)],
                           check=False, capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parents[2])
    assert child.returncode == 0, child.stderr[-2000:]
    seen = json.loads(child.stdout.splitlines()[-1])
    assert seen["failed"] == 120  # no persistent tier took them: none acknowledged
    assert seen["opened"] >= 1
    assert seen["device_errors"] >= 1


async def test_puts_into_a_half_open_log_are_not_refused(tmp_path: Path) -> None:
    """The log's breaker opened on failed flushes, the device healed, and the breaker turned
    half-open: puts into the log append to memory and give no verdict, so they take no probe
    slot (taking the one slot and giving it back, they left the breaker half-open for good and
    refused every put made while one waited)."""
    config = {"health": {"cooldown": "1s"},
              "tiers": [{"name": "nvme", "kind": "nvme", "path": str(tmp_path / "tierkv.log"),
                         "capacity": "64MiB", "region_size": "1MiB"}]}
    plan = FaultPlan().add("nvme", "eio", rate=1.0, ops=["flush"])
    kv = await open_with_faults(config, plan)
    try:
        for i in range(30):
            await kv.put(f"early{i}", b"e" * 1000)
            with contextlib.suppress(tierkv.DeviceError):
                await kv.flush()
            if kv.stats()["tiers"]["nvme"]["breaker"] == "open":
                break
        assert kv.stats()["tiers"]["nvme"]["breaker"] == "open"
        plan.enabled = False
        await asyncio.sleep(2.5)  # the cool-down, and the health watch's next look
        assert kv.stats()["tiers"]["nvme"]["breaker"] == "half_open"
        for round_ in range(10):
            await asyncio.gather(*(kv.put(f"k{round_}-{i}", b"x" * 300_000) for i in range(16)))
        await kv.flush()
        assert await kv.get("k9-15") == b"x" * 300_000
    finally:
        await kv.close()


async def test_settle_returns_after_the_logs_breaker_changed_state(tmp_path: Path) -> None:
    """A breaker leaving the open state cues its tier's evictor; the log has none (it
    reclaims its own space), so its cue stayed set and `settle` spun the loop for good."""
    config = hierarchy_config(tmp_path, ("gpu", "pmem", "nvme"),
                              gpu={"capacity": 256 << 10, "slot_size": 64 << 10, "ttl": "100ms"},
                              pmem={"ttl": "100ms"})
    config["health"] = {"window": "5s", "cooldown": "1s", "close_after": 1}
    plan = FaultPlan().add("nvme", "eio", rate=1.0, ops=["get"])
    plan.enabled = False
    kv = await open_with_faults(config, plan)
    try:
        for i in range(30):
            await kv.put(f"k{i}", bytes([i]) * 60_000)
        await asyncio.sleep(1.5)  # the TTLs take them down into the log
        await asyncio.wait_for(kv.settle(), 10)
        plan.enabled = True
        for _ in range(3):
            for i in range(30):
                await kv.get(f"k{i}")
        plan.enabled = False
        assert kv.stats()["tiers"]["nvme"]["breaker_opened"] >= 1
        await asyncio.sleep(2.5)  # the cool-down: the health watch turns it half-open
        await asyncio.wait_for(kv.settle(), 10)
    finally:
        await kv.close()
