"""The fault soak's read back must not count a read that failed as a lost object.

The soak's final read (after the epoch's last reopen, faults off) is one `get_many` of every key;
reads below the first tier run 32 at a time, each cut off at `[health] slow_operation` (the
soak's config: 100 ms). Reads cut off there miss objects that are on media, and the soak counted
each as a durable object lost: the CI failure (lost 32, checksum failures 2, lost_unexplained 30)
was its 32 reads in flight cut off at once on a loaded machine.

Two ways a read gets cut off, each made here during the final read only:

- the event loop held up (`time.sleep` inside one nvme read, as a process descheduled on a busy
  machine sees it): every read in flight was cut off until c3bddcf (`tierkv._deadline`, the
  stall-aware cut-off); the soak then reported lost 32 / unexplained 30 at seed 0;
- the device slow for a while (32 reads each waiting 150 ms first, as a disk under another
  process's IO): cut off with or without c3bddcf.

The soak reads such misses again, one at a time, while the engine still holds the key
(`tierkv.bench.faults._read_back`), so neither is counted as lost.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tierkv.bench import faults as soak
from tierkv.config import load_config
from tierkv.testing.faults import FaultPlan
from tierkv.tiers.nvme.tier import NvmeTier

SLOW = 0.15  # longer than the config's slow_operation (100 ms)


def _config(directory: Path) -> Path:
    (directory / "pool").mkdir()
    (directory / "log").mkdir()
    path = directory / "devices.toml"
    path.write_text(f"""
[engine]
write_policy = "write_back"

[health]
slow_operation = "100ms"
cooldown = "1s"

[[tiers]]
name = "gpu"
kind = "gpu"
device = "cpu"
capacity = "1MiB"
slot_size = "16KiB"

[[tiers]]
name = "pmem"
kind = "pmem"
path = "{directory / "pool" / "tierkv.pool"}"
capacity = "8MiB"

[[tiers]]
name = "nvme"
kind = "nvme"
path = "{directory / "log" / "tierkv.log"}"
capacity = "64MiB"
region_size = "1MiB"
""")
    return path


class _SlowReads:
    """Once armed, the `after`-th nvme read holds the event loop for `SLOW` seconds (``stall``,
    the reads started before it in flight), or that read and the 31 after it each wait `SLOW`
    seconds first (a slow device)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, after: int, *, stall: bool) -> None:
        self.after, self.stall, self.calls, self.armed, self.slowed = after, stall, 0, False, 0
        read = NvmeTier.get

        async def get(tier: NvmeTier, key: bytes) -> object:
            if self.armed:
                self.calls += 1
                if self.stall and self.calls == self.after:
                    self.armed, self.slowed = False, 1
                    time.sleep(SLOW)  # noqa: ASYNC251 - the loop held up is the point
                elif not self.stall and self.after <= self.calls < self.after + 32:
                    self.slowed += 1
                    await asyncio.sleep(SLOW)
            return await read(tier, key)

        monkeypatch.setattr(NvmeTier, "get", get)

    def arm(self) -> None:
        self.armed, self.calls = True, 0


@pytest.mark.pmem
@pytest.mark.parametrize("stall", [True, False], ids=["loop stall", "slow device"])
async def test_reads_cut_off_during_the_read_back_are_not_lost_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stall: bool) -> None:
    """The soak of `tests/bench/test_faults_bench.py` (1,500 operations, 4 clients, its faults,
    seed 0), its final read slowed as the parameter says: no unexplained loss."""
    config = load_config(_config(tmp_path))
    recovery = soak._recovery
    slow = _SlowReads(monkeypatch, after=16, stall=stall)

    def armed(stats: dict[str, object]) -> dict[str, object]:
        slow.arm()  # called right after the epoch's last reopen, before its read back
        return recovery(stats)

    monkeypatch.setattr(soak, "_recovery", armed)
    plan = FaultPlan.parse("pmem:eio=0.05,nvme:torn=0.03,nvme:flip=0.03,"
                           "nvme:latency=0.02@150ms", seed=0)
    result, _rows = await soak.run_fault_soak(config, plan, operations=1500, clients=4,
                                              size=64 << 10)
    figures = {name: result[name] for name in ("lost", "checksum_failures_detected",
                                               "lost_unexplained", "lost_from")}
    figures.update({name: result["counts"].get(name, 0) for name in ("reread",
                                                                     "reread_failed")})
    print(figures)
    assert slow.slowed and result["served_corrupt"] == 0
    assert result["lost_unexplained"] == 0, figures
