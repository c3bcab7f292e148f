"""kill -9 across the whole hierarchy: gpu → pmem → nvme, small enough that demotion runs.

The writer (`tests.engine._hierarchy_writer`) puts 64 KiB objects into gpu 4 MiB (64 KiB slots)
→ pmem 8 MiB → nvme 256 MiB (1 MiB regions): L1 overflows after 64 objects and the pool after
about a hundred, so objects move L1 → pmem → nvme while the writer runs. It prints what is
acknowledged — under write_through each put that returned, under write_back what a returned
`flush()` covered — and is killed with SIGKILL; the reopened engine must return every
acknowledged object byte for byte. The log is far larger than anything written here, so the last
tier never has a reason to drop an object: a missing acknowledged object is a lost one.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import crash_hierarchy
from tests.engine._hierarchy_writer import value_of

pytestmark = [pytest.mark.crash, pytest.mark.pmem]
ROOT = Path(__file__).resolve().parents[2]
#: a writer that has not reached its kill point by then is killed and the test fails (a hang)
WRITER_LIMIT = 120.0
BASE_SEED = os.environ.get("TIERKV_CRASH_SEED", "tierkv-hierarchy-crash")


@dataclass
class WriterRun:
    """What a killed writer reported before its death."""

    acked: set[int] = field(default_factory=set)
    returned: set[int] = field(default_factory=set)
    done: bool = False
    killed_by_watchdog: bool = False
    stderr: str = ""


def run_writer(directory: Path, policy: str, args: Sequence[object], *,
               kill_after_acks: int | None = None, linger: float = 0.0) -> WriterRun:
    """Run the writer (``args``: MODE PREFIX A B) and SIGKILL it at ``DONE`` or once
    `kill_after_acks` objects are acknowledged (after `linger` seconds more); every line it
    printed before dying counts."""
    log_path = directory / f"writer-{args[1]}.stderr"
    with log_path.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.engine._hierarchy_writer", str(directory), policy,
             *map(str, args)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    run = WriterRun()

    def watchdog() -> None:
        run.killed_by_watchdog = True
        process.kill()

    timer = threading.Timer(WRITER_LIMIT, watchdog)
    timer.start()
    assert process.stdout is not None
    try:
        for line in process.stdout:
            run.done = run.done or consume(run, line)
            if run.done or (kill_after_acks is not None and len(run.acked) >= kill_after_acks):
                if linger:
                    time.sleep(linger)
                break
    finally:
        timer.cancel()
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        try:
            # what it printed before the kill was acknowledged too
            for line in process.stdout:
                run.done = run.done or consume(run, line)
        finally:
            process.stdout.close()
    run.stderr = log_path.read_text()[-3000:]
    return run


def consume(run: WriterRun, line: str) -> bool:
    """Record one line of the writer; whether it was ``DONE``. A last line without its newline
    was cut by the kill: it says nothing (``PUT 12`` cut to ``PUT 1`` would name another
    object)."""
    words = line.split()
    if not words or not line.endswith("\n"):
        return False
    if words[0] == "ACK":
        run.acked.update(int(w) for w in words[1:])
    elif words[0] == "PUT":
        run.returned.add(int(words[1]))
    return words[0] == "DONE"


async def check_survivors(directory: Path, policy: str, expected: dict[str, set[int]],
                          context: str, *, demoted_to_nvme: bool = False) -> None:
    """Reopen and demand every acknowledged object, exact. With `demoted_to_nvme`, also the
    premise: some acknowledged objects were found in the nvme log (demotion reached it)."""
    lost: list[str] = []
    wrong: list[str] = []
    where: dict[str | None, int] = {}
    total = sum(len(ids) for ids in expected.values())
    async with tierkv.open(crash_hierarchy(directory, policy)) as kv:
        keys = [(prefix, i) for prefix, ids in expected.items() for i in sorted(ids)]
        for prefix, i in keys:  # before any get, which may promote what it reads
            tier = await kv.locate(f"{prefix}{i}")
            where[tier] = where.get(tier, 0) + 1
        for prefix, i in keys:
            got = await kv.get(f"{prefix}{i}")
            if got is None:
                lost.append(f"{prefix}{i}")
            elif got != value_of(prefix, i):
                wrong.append(f"{prefix}{i}")
    assert not lost and not wrong, (
        f"{context}: {len(lost)} of {total} acknowledged objects lost after SIGKILL "
        f"{sorted(lost, key=_order)}; {len(wrong)} came back with wrong bytes "
        f"{sorted(wrong, key=_order)}; after reopen they were in {where}"
    )
    if demoted_to_nvme:
        assert where.get("nvme", 0) > 0, (
            f"{context}: premise: no acknowledged object reached the nvme log ({where}), so "
            f"the test did not exercise demotion pmem → nvme"
        )


async def check_unacknowledged_are_whole(directory: Path, policy: str, prefix: str,
                                         ids: set[int], context: str) -> None:
    """Objects whose put returned but that nothing acknowledged: absent or exact, never torn."""
    torn: list[int] = []
    async with tierkv.open(crash_hierarchy(directory, policy)) as kv:
        for i in sorted(ids):
            got = await kv.get(f"{prefix}{i}")
            if got is not None and got != value_of(prefix, i):
                torn.append(i)
    assert not torn, f"{context}: unacknowledged objects came back with wrong bytes: {torn}"


def _order(key: str) -> tuple[str, int]:
    head = key.rstrip("0123456789")
    return head, int(key[len(head):])


def explain(run: WriterRun) -> str:
    tail = run.stderr.strip().splitlines()[-5:]
    return f"writer stderr tail: {tail}" if tail else "writer stderr empty"


async def test_write_through_200_acknowledged_puts_survive_sigkill(tmp_path: Path) -> None:
    """Issue scenario (a): 200 write_through puts of 64 KiB, each acknowledged, then SIGKILL."""
    run = run_writer(tmp_path, "write_through", ("fixed", "a", 200, 0))
    assert not run.killed_by_watchdog, f"the writer hung: {explain(run)}"
    assert run.done and len(run.acked) == 200, (
        f"the writer died after {len(run.acked)} acknowledgements: {explain(run)}"
    )
    await check_survivors(tmp_path, "write_through", {"a": run.acked},
                          "write_through, 200 x 64 KiB", demoted_to_nvme=True)


async def test_write_back_flushed_200_survive_sigkill_with_100_unflushed(tmp_path: Path) -> None:
    """Issue scenario (b): 200 puts, `flush()` returns, 100 more puts unflushed, SIGKILL."""
    run = run_writer(tmp_path, "write_back", ("fixed", "b", 200, 100))
    assert not run.killed_by_watchdog, f"the writer hung: {explain(run)}"
    assert run.done and len(run.acked) == 200 and len(run.returned) == 300, (
        f"the writer died early ({len(run.acked)} acknowledged, {len(run.returned)} put): "
        f"{explain(run)}"
    )
    await check_survivors(tmp_path, "write_back", {"b": run.acked},
                          "write_back, 200 flushed + 100 unflushed x 64 KiB",
                          demoted_to_nvme=True)
    await check_unacknowledged_are_whole(tmp_path, "write_back", "b",
                                         run.returned - run.acked, "write_back, 100 unflushed")


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_random_kill_points_across_the_hierarchy(tmp_path: Path, policy: str) -> None:
    """The writer loops; SIGKILL at a random acknowledgement count, three times on the same
    media. After each crash every object acknowledged in any round so far must be there."""
    seed = f"{BASE_SEED}-{policy}"
    rng = random.Random(seed)
    expected: dict[str, set[int]] = {}
    for round_ in range(3):
        prefix = f"r{round_}-"
        kill_at = rng.randrange(20, 260)
        linger = rng.choice([0.0, 0.0, rng.uniform(0.0, 0.05)])
        flush_every = rng.randrange(3, 17)
        run = run_writer(tmp_path, policy, ("loop", prefix, flush_every, 0),
                         kill_after_acks=kill_at, linger=linger)
        context = (f"{policy}, seed {seed!r}, round {round_}: SIGKILL once {kill_at} were "
                   f"acknowledged (+{linger:.3f}s, flush every {flush_every}; "
                   f"{len(run.acked)} acknowledged by then)")
        assert not run.killed_by_watchdog, f"{context}: the writer hung: {explain(run)}"
        assert len(run.acked) >= kill_at, f"{context}: the writer died early: {explain(run)}"
        expected[prefix] = run.acked
        await check_survivors(tmp_path, policy, expected, context)
        await check_unacknowledged_are_whole(tmp_path, policy, prefix,
                                             run.returned - run.acked, context)
