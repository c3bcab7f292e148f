"""A process that forks (multiprocessing's default on Linux, a data loader's workers) while
an engine is open: its children must not hold the media locks. They held the log's flock and
the pool's (through PMDK's descriptor and the pool's mapping), and every later open of the
media was refused as in use for as long as a child lived, after a clean close and after the
engine's process died alike."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import hierarchy_config

pytestmark = pytest.mark.pmem


def fork_idle_worker() -> int:
    """Fork a child that never touches the engine and lives on; its pid."""
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    return child


async def test_a_forked_child_does_not_keep_the_media_locked(tmp_path: Path) -> None:
    config = hierarchy_config(tmp_path, ("pmem", "nvme"))
    kv = await tierkv.open(config)
    try:
        await kv.put("k", b"v" * 5000)
        await kv.flush()
        child = fork_idle_worker()
    finally:
        await kv.close()
    try:
        async with tierkv.open(config) as reopened:  # the child still runs
            assert await reopened.get("k") == b"v" * 5000
    finally:
        os.kill(child, signal.SIGKILL)
        await asyncio.to_thread(os.waitpid, child, 0)
