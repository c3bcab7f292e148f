"""Under ``write_through`` a delete that returned is on media: kill -9 right after it, and the
reopened engine serves nothing of the key. The nvme log's delete is a tombstone in its head
buffer, durable only once the head is synced; the engine used to sync it only at the next
flush, so a crash brought every such deleted value back. Worse, an older value that had
expired out of the log (its tombstone unsynced too) came back after a newer, acknowledged value
was deleted from the pool, which frees at once."""

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
from tests.engine._configs import MiB, hierarchy_config

pytestmark = pytest.mark.crash
ROOT = Path(__file__).resolve().parents[2]
KEYS = 8

#: puts `KEYS` values (after letting older ones expire out of every tier, with "expire"),
#: deletes them, says so and waits to be killed
WRITER = """
import asyncio, json, sys
import tierkv

async def main():
    kv = await tierkv.open(json.loads(sys.argv[1]))
    keys = [f"k{i}" for i in range(int(sys.argv[2]))]
    if sys.argv[3] == "expire":
        for i, key in enumerate(keys):
            await kv.put(key, b"OLD" + bytes([i]) * 100_000)
        for _ in range(200):  # until the old values expired out of the pool and the log
            await asyncio.sleep(0.05)
            if all([await kv.locate(key) is None for key in keys]):
                break
        else:
            raise SystemExit("the old values never expired")
    for i, key in enumerate(keys):
        await kv.put(key, b"NEW" + bytes([i]) * 100_000)
    for key in keys:
        assert await kv.delete(key)
    print("DELETED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def run_and_kill(config: dict[str, Any], mode: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(config), str(KEYS), mode],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    assert line.strip() == "DELETED", "the writer died before its deletes returned"


async def served(config: dict[str, Any]) -> dict[str, bytes]:
    async with tierkv.open(config) as kv:
        found = {f"k{i}": await kv.get(f"k{i}") for i in range(KEYS)}
    return {key: bytes(value[:3]) for key, value in found.items() if value is not None}


@pytest.mark.parametrize("kinds", [("nvme",), ("gpu", "nvme")], ids="-".join)
async def test_a_returned_delete_survives_sigkill(tmp_path: Path, kinds: tuple[str, ...]
                                                  ) -> None:
    config = hierarchy_config(tmp_path, kinds, write_policy="write_through")
    run_and_kill(config, "plain")
    assert await served(config) == {}


@pytest.mark.pmem
async def test_an_expired_older_value_stays_gone_after_a_delete_and_sigkill(tmp_path: Path
                                                                           ) -> None:
    config = hierarchy_config(tmp_path, ("pmem", "nvme"), write_policy="write_through",
                              pmem={"ttl": "300ms"},
                              nvme={"capacity": 64 * MiB, "ttl": "600ms"})
    run_and_kill(config, "expire")
    assert await served(config) == {}
