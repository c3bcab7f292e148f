"""kill -9 of a process using the engine: every acknowledged object survives, intact.

write_through acknowledges each put once a persistent tier holds it on media; write_back
acknowledges what a `flush()` covered. The writer runs in a subprocess killed with SIGKILL at a
random point; the reopened engine must return every acknowledged object with its exact bytes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tierkv
from tests.engine._engine_writer import value_of
from tests.engine.test_hierarchy import hierarchy

pytestmark = pytest.mark.crash
ROOT = Path(__file__).resolve().parents[2]


def run_and_kill(directory: Path, policy: str, with_pmem: bool, acks: int) -> set[int]:
    """Start the writer, wait for `acks` acknowledgements, SIGKILL it; the acknowledged ids."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.engine._engine_writer", str(directory), policy,
         "pmem" if with_pmem else "nopmem"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    acknowledged: set[int] = set()
    assert process.stdout is not None
    try:
        for line in process.stdout:
            words = line.split()
            if words and words[0] == "ACK":
                acknowledged.update(int(w) for w in words[1:])
            if len(acknowledged) >= acks:
                break
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    assert len(acknowledged) >= acks, "the writer died before acknowledging enough puts"
    return acknowledged


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("with_pmem", [pytest.param(False, id="gpu-nvme"),
                                       pytest.param(True, id="gpu-pmem-nvme",
                                                    marks=pytest.mark.pmem)])
async def test_acknowledged_objects_survive_sigkill(
    tmp_path: Path, policy: str, with_pmem: bool
) -> None:
    rng = random.Random(f"{policy}-{with_pmem}")
    for _round in range(2):  # the second round writes over the media the first one crashed on
        acknowledged = run_and_kill(tmp_path, policy, with_pmem, rng.randrange(5, 40))
        async with tierkv.open(hierarchy(tmp_path, pmem=with_pmem)) as kv:
            for i in sorted(acknowledged):
                assert await kv.get(f"k{i}") == value_of(i), f"acknowledged object k{i} lost"
            assert kv.stats()["engine"]["corrupt_reads"] == 0
