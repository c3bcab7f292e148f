"""Recovery time: opening a full 1 GiB pmem pool and a full 10 GiB nvme log, after a clean close
and after a `kill -9`.

A writer process fills a pmem → nvme hierarchy (the config's pmem and nvme tiers, resized; the
pool first, the log behind it) with 256 KiB objects until both are full, flushes, and then either
closes (the log writes its checkpoint) or is killed with SIGKILL (the next open scans the log's
regions and walks the pool). Timed in this process: `tierkv.open` of the same config, which
recovers both tiers and indexes every object (the engine's `recovery_s`); objects per second
beside the bytes the media hold. `--quick`: a 64 MiB pool and a 1 GiB log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from tierkv.bench.common import Progress, Row, no_progress
from tierkv.config import Config, NvmeTierConfig, PmemTierConfig
from tierkv.engine import open as open_engine
from tierkv.errors import ConfigError

OBJECT = 256 << 10
_WRITER = """
import asyncio, json, sys, time
import tierkv
config, count, mode = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

async def main():
    kv = await tierkv.open(config)
    value = bytes(range(256)) * 1024
    for i in range(count):
        await kv.put(b"recovery%d" % i, value)
    await kv.flush()
    if mode == "close":
        await kv.close()
        print("CLOSED", flush=True)
        return
    print("FLUSHED", flush=True)
    time.sleep(600)

asyncio.run(main())
"""


def _tiers(config: Config) -> tuple[PmemTierConfig, NvmeTierConfig]:
    pmem = next((t for t in config.tiers if isinstance(t, PmemTierConfig)), None)
    nvme = next((t for t in config.tiers if isinstance(t, NvmeTierConfig)), None)
    if pmem is None or nvme is None:
        raise ConfigError("--device recovery: the config needs a pmem and an nvme tier")
    return pmem, nvme


def _config(config: Config, pool: Path, log: Path, quick: bool) -> dict[str, Any]:
    pmem, nvme = _tiers(config)
    pool_size, log_size = (64 << 20, 1 << 30) if quick else (1 << 30, 10 << 30)
    return {"scheduler": {"background_bandwidth": "off"}, "tiers": [
        {"name": pmem.name, "kind": "pmem", "path": str(pool), "capacity": pool_size,
         "format": True},
        {"name": nvme.name, "kind": "nvme", "path": str(log),
         "capacity": 4096 + log_size, "region_size": nvme.region_size,
         "queue_depth": nvme.queue_depth, "direct": nvme.direct, "format": True}]}


async def _fill(config: dict[str, Any], count: int, mode: str) -> None:
    """A fresh pool and log filled by a writer process that closes or is killed (`mode`).
    The writer is a session of its own, awaited without blocking the loop, and killed if the
    bench is cut short: a Ctrl-C reached it too (its traceback, then "the writer stopped
    early" and a traceback of the CLI's), and a SIGTERM to the CLI waited for the whole fill."""
    for tier in config["tiers"]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tier["path"])
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WRITER, json.dumps(config), str(count), mode,
        stdout=asyncio.subprocess.PIPE, start_new_session=True)
    line = ""
    try:
        assert writer.stdout is not None
        line = (await writer.stdout.readline()).decode().strip()
    finally:
        if mode == "kill" or not line:
            with contextlib.suppress(ProcessLookupError):
                os.kill(writer.pid, signal.SIGKILL)
        await asyncio.wait_for(writer.wait(), 600)
    expected = "CLOSED" if mode == "close" else "FLUSHED"
    if line != expected:
        raise RuntimeError(f"the recovery writer stopped early ({line!r})")


async def _reopen(config: dict[str, Any]) -> dict[str, Any]:
    async with open_engine(config) as kv:
        stats = kv.stats()
    engine = stats["engine"]
    objects = sum(engine["recovered"].values())
    return {"seconds": engine["recovery_s"], "objects": objects,
            "objects_per_s": objects / engine["recovery_s"] if engine["recovery_s"] else 0.0,
            "nvme_recovered_from": next((t.get("recovered_from") for t in
                                         stats["tiers"].values() if "recovered_from" in t), None)}


async def run_recovery_bench(config: Config, *, quick: bool = False,
                             progress: Progress = no_progress
                             ) -> tuple[dict[str, Any], list[Row]]:
    pmem, nvme = _tiers(config)
    results: dict[str, Any] = {}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="tierkv-", dir=pmem.path.parent) as pool_dir, \
            tempfile.TemporaryDirectory(prefix="tierkv-", dir=nvme.path.parent) as log_dir:
        sized = _config(config, Path(pool_dir) / "p.pool", Path(log_dir) / "n.log", quick)
        total = sized["tiers"][0]["capacity"] + sized["tiers"][1]["capacity"]
        count = int(total * 0.97) // OBJECT
        for step, mode in enumerate(("close", "kill")):
            progress("recovery: fill", step, 2)
            await _fill(sized, count, mode)
            reopened = dict(sized, tiers=[dict(t, format=False) for t in sized["tiers"]])
            results[mode] = measured = await _reopen(reopened)
            rows.append(Row(f"recovery after {'a clean close' if mode == 'close' else 'kill -9'}"
                            f" ({total >> 20:,} MiB of pmem + nvme)", "objects/s",
                            measured["objects_per_s"]))
    progress("recovery: fill", 2, 2)
    results["objects_written"] = count
    results["bytes"] = total
    return results, rows

