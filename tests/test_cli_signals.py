"""SIGTERM ends a command as Ctrl-C does: the command's clean-up runs (the scratch media of
`tierkv bench`: pools on /dev/shm are RAM), and the CLI exits 143."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._three_tiers import three_tier_toml
from tierkv._cli_signals import EXIT_TERMINATED, Terminated, run, terminable


def test_sigterm_cancels_the_running_command_and_its_clean_up_runs() -> None:
    cleaned: list[str] = []

    async def command() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        finally:
            cleaned.append("async")

    with pytest.raises(Terminated), terminable():
        try:
            run(command())
        finally:
            cleaned.append("sync")
    assert cleaned == ["async", "sync"]
    assert signal.getsignal(signal.SIGTERM) is not signal.getsignal(signal.SIGINT)


def test_sigterm_between_runs_unwinds_too() -> None:
    with pytest.raises(Terminated), terminable():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


def _trace(path: Path, requests: int) -> Path:
    rng = random.Random(3)
    lines = []
    for i in range(requests):
        ids = [rng.randrange(requests // 4) for _ in range(rng.randrange(1, 12))]
        lines.append(json.dumps({"timestamp": i * 100, "input_length": 512 * len(ids),
                                 "output_length": 1, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.pmem
def test_a_terminated_trace_replay_leaves_no_scratch_media(tmp_path: Path) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(three_tier_toml(tmp_path))
    trace = _trace(tmp_path / "trace.jsonl", 200_000)
    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:
        bench = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "bench", "--config", str(config), "--trace",
             str(trace), "--capacity", "25%", "--block-size", "4KiB"],
            stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "log").glob("tierkv-trace-*/*")):  # its scratch log is made
            assert bench.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, "the replay never made its scratch media"
            time.sleep(0.05)
        time.sleep(0.5)  # replaying
        assert bench.poll() is None, "the replay ended before it could be terminated"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == EXIT_TERMINATED
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    left = [path for directory in ("pool", "log")
            for path in (tmp_path / directory).glob("tierkv-trace-*")]
    assert not left
