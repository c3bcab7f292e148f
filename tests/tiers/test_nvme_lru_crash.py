"""LRU reclaim never brings back a deleted or overwritten entry after a crash.

A writer process runs a seeded mix of overwrites, deletes and reads (which make LRU pick other
victims than FIFO would) over six 1 MiB regions, flushing after every ten operations, and is
killed with SIGKILL at a random point. After reopening by scan, every recovered key must hold the
version the model says was current at the last acknowledged flush, or one the writer put after it;
an older version, a deleted key or a dropped key coming back is a resurrection.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers._nvme_support import nvme_config
from tests.tiers._nvme_writer import key_id, versioned
from tierkv.config import NvmeBackend, RegionEviction
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier

ROOT = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("_nvme_writer.py")


def _run_and_kill(directory: Path, seed: int, acks: int) -> list[list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), "lru", str(directory), "threads", str(seed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
    )
    lines: list[list[str]] = []
    assert proc.stdout is not None and proc.stderr is not None
    try:
        for raw in proc.stdout:
            lines.append(raw.decode().split())
            if lines[-1] == ["ACK"]:
                acks -= 1
                if acks <= 0:
                    break
    finally:
        proc.send_signal(signal.SIGKILL)
        # the rest of the output, from the same buffered reader: ops printed after the kill
        # decision still count (each is printed before it is done); a line cut by the kill
        # has no newline and is dropped
        rest = proc.stdout.read().decode()
        err = proc.stderr.read().decode()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, err
    complete = rest.split("\n")[:-1]
    lines += [line.split() for line in complete if line.strip()]
    return lines


def _model(lines: list[list[str]]) -> tuple[dict[int, int], dict[int, set[int]], dict[str, int]]:
    """(version of each live key at the last ACK, versions put after it, op counts)."""
    state: dict[int, int] = {}
    acked: dict[int, int] = {}
    tail: dict[int, set[int]] = {}
    counts = {"PUT": 0, "DEL": 0, "DROP": 0, "overwrite": 0}
    for words in lines:
        op, args = words[0], [int(w) for w in words[1:]]
        if op == "PUT":
            counts["overwrite"] += args[0] in state
            state[args[0]] = args[1]
            tail.setdefault(args[0], set()).add(args[1])
        elif op in ("DEL", "DROP"):
            for i in args:
                state.pop(i, None)
        elif op == "ACK":
            acked, tail = dict(state), {}
        counts[op] = counts.get(op, 0) + 1
    return acked, tail, counts


@pytest.mark.crash
async def test_lru_reclaim_never_resurrects_after_kill_9(tmp_path: Path) -> None:
    rng = random.Random(99)
    for attempt in range(3):
        directory = tmp_path / f"run{attempt}"
        directory.mkdir()
        lines = _run_and_kill(directory, seed=attempt, acks=rng.randint(60, 120))
        acked, tail, counts = _model(lines)
        # the run must have exercised what can resurrect: overwrites, deletes, reclaims
        assert counts["overwrite"] and counts["DEL"] and counts["DROP"]
        tier = NvmeTier(nvme_config(directory, regions=6, reinsert_hits=0,
                                    backend=NvmeBackend.THREADS, eviction=RegionEviction.LRU))
        recovered = await tier.open()
        try:
            assert tier.stats()["recovered_from"] == "scan"
            for r in recovered:
                i = key_id(r.key)
                got = await tier.get(r.key)
                assert got is not None
                data = payload_bytes(got[1])
                stamp = int(data[:8])
                assert stamp // 10000 == i
                assert data == versioned(i, stamp % 10000)  # intact
                allowed = tail.get(i, set()) | ({acked[i]} if i in acked else set())
                assert stamp in allowed, (
                    f"key {i}: version {stamp % 10000} resurrected "
                    f"(acknowledged: {acked.get(i)}, put since: {sorted(tail.get(i, ()))})"
                )
            assert recovered
        finally:
            await tier.close()

