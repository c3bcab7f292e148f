"""`tierkv bench --faults SPEC`, the fault soak, at a size CI affords: the command runs, injects
what it was told, checks every answer and reports no corrupt or stale value and no unexplained
loss; it leaves no scratch media behind; a bad spec or a fault that could never fire is one line
and exit 2. The values' encoding is what lets the soak recognise what a get served."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from tests._three_tiers import three_tier_toml
from tierkv.bench import faults as soak
from tierkv.bench.faults import MIN_VALUE, decode, encode, run_fault_soak
from tierkv.cli import main
from tierkv.config import load_config
from tierkv.testing.faults import FaultPlan
from tierkv.tiers.nvme.tier import NvmeTier


def _leftovers(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("tierkv-soak-*")]


def test_a_value_says_which_key_and_version_it_is() -> None:
    value = encode(b"k", 7, 1000)
    assert len(value) == 1000 and decode(b"k", value) == 7
    assert decode(b"other", value) is None
    flipped = bytearray(value)
    flipped[500] ^= 0x10
    assert decode(b"k", bytes(flipped)) is None
    assert decode(b"k", value[:-1]) is None
    assert decode(b"k", encode(b"k", 8, MIN_VALUE)) == 8


@pytest.mark.pmem
def test_the_soak_runs_from_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(three_tier_toml(tmp_path))
    out = tmp_path / "soak.json"
    # the log's device writes are few (a region at a time, some tens a run): at 0.03 a torn
    # write fired 1-3 times a run, and none in about one run of five
    spec = "pmem:eio=0.05,nvme:torn=0.15,nvme:flip=0.03,nvme:latency=0.02@150ms"
    assert main(["bench", "--config", str(config), "--faults", spec, "--quick",
                 "--count", "1500", "--concurrency", "4", "--size", "64KiB",
                 "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    result = document["results"]["faults"]
    assert result["faults"] == spec and result["operations"] == 1500
    counts = result["counts"]
    assert counts["gets_checked"] > 500 and counts["hits"] > counts["misses"]
    assert counts["cancelled"] > 0 and counts["reopens"] > 0
    assert set(result["faults_fired"]) >= {"pmem:eio", "nvme:torn", "nvme:latency"}
    assert result["served_corrupt"] == result["served_stale"] == 0
    # where a loss came from, should one happen: the tiers the objects were last seen in, and
    # what the last reopen recovered and let go
    diagnostics = {name: result[name] for name in (
        "lost", "checksum_failures_detected", "lost_from", "final_reopens", "counts",
        "faults_fired", "breaker_transitions")}
    assert result["lost_unexplained"] == 0 and result["stuck"] == 0, diagnostics
    goals = {row["case"]: row["meets_target"] for row in document["rows"]
             if row["meets_target"] is not None}
    assert goals and all(goals.values()), goals
    assert not _leftovers(tmp_path)


@pytest.mark.pmem
def test_the_soak_runs_under_the_seed_it_is_given(tmp_path: Path) -> None:
    """`--seed` seeds the fault draws and the clients' choices, and the report records it (the
    background moves' timing still makes no two runs identical)."""
    config = tmp_path / "devices.toml"
    config.write_text(three_tier_toml(tmp_path))
    out = tmp_path / "soak.json"
    assert main(["bench", "--config", str(config), "--faults", "pmem:eio=0.2",
                 "--count", "150", "--concurrency", "1", "--seed", "7",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["faults"]
    assert result["seed"] == 7 and result["operations"] == 150
    assert result["faults_fired"]["pmem:eio"] > 0
    assert result["lost_unexplained"] == 0 and result["served_corrupt"] == 0


@pytest.mark.pmem
async def test_write_through_loses_nothing_to_failing_writes_and_hung_reads(
        tmp_path: Path) -> None:
    """Under write-through every put that returned is durable: EIO and torn writes on nvme,
    EIO on pmem and hung nvme reads (cut off) must lose none of them."""
    path = tmp_path / "devices.toml"
    path.write_text(three_tier_toml(tmp_path, "write_through"))
    config = load_config(path)
    plan = FaultPlan.parse("pmem:eio=0.05,nvme:eio=0.02,nvme:torn=0.05,"
                           "nvme:hang=0.02;ops=get", seed=3)
    # the log's device writes are few (whole regions): at 5 % none was torn in one CI run, so
    # the second one always is
    plan.add("nvme", "torn", schedule=(2,), ops=("put",))
    result, _rows = await run_fault_soak(config, plan, operations=1200, clients=4,
                                         size=64 << 10, rounds=3)
    assert result["lost"] == 0 and result["served_corrupt"] == 0
    assert result["served_stale"] == 0 and result["stuck"] == 0
    assert {"nvme:hang", "nvme:torn"} <= set(result["faults_fired"])
    assert not _leftovers(tmp_path)


@pytest.mark.parametrize(("spec", "device"), [
    ("pmem:eio=2", "engine"),  # a rate beyond 1
    ("nvme:latency=0.1", "engine"),  # a latency without its duration
    ("nvme:eio=0.1;ops=read", "engine"),
    ("pmem:eio=0.1", "nvme"),  # faults go into the engine only
])
def test_a_bad_spec_is_one_line_and_exit_2(tmp_path: Path, spec: str, device: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(three_tier_toml(tmp_path))
    assert main(["bench", "--config", str(config), "--device", device, "--faults", spec,
                 "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--faults" in err


def test_a_fault_that_could_never_fire_is_refused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "devices.toml"
    config.write_text('[[tiers]]\nname = "gpu"\nkind = "gpu"\ndevice = "cpu"\n'
                      'capacity = "1MiB"\nslot_size = "16KiB"\n')
    assert main(["bench", "--config", str(config), "--faults", "nvme:flip=0.1",
                 "--quick"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# -- the read back: a read cut off is a failed read, not a lost object ------------------------
# The soak's final read (after the epoch's last reopen, faults off) is one `get_many` of every
# key; reads below the first tier run 32 at a time, each cut off at `[health] slow_operation`
# (here 100 ms). One CI run counted 32 objects on media as lost this way (lost 32, checksum
# failures 2, lost_unexplained 30): its 32 reads in flight cut off at once on a loaded machine.
# A stall of the loop no longer cuts reads off (`tierkv._deadline`); a slow device still does,
# and the soak reads such misses again while the engine holds the key (`faults._read_back`).

SLOW = 0.15  # longer than the config's slow_operation (100 ms)


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
    path = tmp_path / "devices.toml"
    path.write_text(three_tier_toml(tmp_path))
    config = load_config(path)
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
