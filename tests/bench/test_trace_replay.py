"""`tierkv bench --trace`: the trace reader, the offline LRU and MIN baselines, the capacity
points the engine is resized to, the replay under prefix semantics, and the command line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tierkv
from tests._endless import KINDS, endless_input, run_capped
from tests.engine.conftest import l1_config
from tierkv.bench.trace import (
    TraceClock,
    block_key,
    read_trace,
    replay_point,
)
from tierkv.bench.trace_baselines import lru_hit_ratio, min_hit_ratio
from tierkv.bench.trace_config import ReplayPolicy, capacity_point, tier_shares
from tierkv.cli import main
from tierkv.config import (
    MIN_PMEM_POOL,
    NVME_SUPERBLOCK,
    Admission,
    Config,
    EvictionPolicy,
    GpuTierConfig,
    NvmeTierConfig,
    PmemTierConfig,
)

KiB = 1 << 10
MiB = 1 << 20
FAST = settings(max_examples=200, deadline=None)


def write_trace(path: Path, requests: list[list[int]], step_ms: int = 1000) -> Path:
    path.write_text("".join(
        json.dumps({"timestamp": i * step_ms, "input_length": 512 * len(ids),
                    "output_length": 1, "hash_ids": ids}) + "\n"
        for i, ids in enumerate(requests)
    ))
    return path


# -- reading -------------------------------------------------------------------------------------
def test_requests_come_with_their_timestamp_in_seconds(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[0, 1], [0, 2, 3], [4]], step_ms=1500)
    requests = list(read_trace(trace))
    assert requests == [(0.0, (0, 1)), (1.5, (0, 2, 3)), (3.0, (4,))]
    timestamp, ids = requests[1]
    assert (timestamp, ids) == (requests[1].timestamp, requests[1].hash_ids)
    assert len(list(read_trace(trace, limit=2))) == 2


@pytest.mark.parametrize("line", [
    "not json",
    '[1, 2]',
    '{"hash_ids": [1]}',
    '{"timestamp": -1, "hash_ids": [1]}',
    '{"timestamp": "0", "hash_ids": [1]}',
    '{"timestamp": 0, "hash_ids": "nope"}',
    '{"timestamp": 0, "hash_ids": [1, true]}',
    '{"timestamp": 0, "hash_ids": [-1]}',
    '{"timestamp": 0, "hash_ids": [18446744073709551616]}',
    '{"timestamp": 0, "hash_ids": [1], "input_length": 2.5}',
    # an OverflowError, a RecursionError and a ValueError of int() escaped the checks
    '{"timestamp": ' + "9" * 400 + ', "hash_ids": [1]}',
    "[" * 100_000 + "]" * 100_000,
    '{"timestamp": 0, "hash_ids": [' + "9" * 6000 + "]}",
])
def test_a_bad_record_is_named_by_file_and_line(tmp_path: Path, line: str) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [7]}\n\n' + line + "\n")
    with pytest.raises(ValueError) as caught:
        list(read_trace(trace))
    assert f"{trace}:3" in str(caught.value)  # the message names the line: that is the point


def test_bytes_that_are_not_utf8_are_named_by_file_and_line(tmp_path: Path) -> None:
    # the decoding error escaped the per-line checks, naming neither file nor line
    trace = tmp_path / "binary.jsonl"
    trace.write_bytes(b'{"timestamp": 0, "hash_ids": [7]}\n\x87\xff\x00\n')
    with pytest.raises(ValueError, match="not UTF-8") as caught:
        list(read_trace(trace))
    assert f"{trace}:2" in str(caught.value)


def test_a_trace_going_back_in_time_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "back.jsonl"
    trace.write_text('{"timestamp": 20, "hash_ids": [1]}\n{"timestamp": 10, "hash_ids": [2]}\n')
    with pytest.raises(ValueError) as caught:
        list(read_trace(trace))
    assert f"{trace}:2" in str(caught.value)


def test_keys_depend_on_position_and_id() -> None:
    assert block_key(7, 0) == block_key(7, 0)
    assert block_key(7, 0) != block_key(7, 1)
    assert block_key(7, 0).digest != block_key(8, 0).digest


# -- offline baselines ---------------------------------------------------------------------------
def test_lru_counts_the_leading_run_and_evicts_least_recent() -> None:
    requests = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    # 4 blocks: r1 misses all (cache 1 2 3); r2 hits 1 2, inserts 4 (3 1 2 4, LRU first);
    # r3 hits 1 2 3: 5 of 9
    assert lru_hit_ratio(requests, 4) == 5 / 9
    # 3 blocks: r2 hits 1 2, inserting 4 evicts 3 (1 2 4); r3 hits 1 2, misses 3: 4 of 9
    assert lru_hit_ratio(requests, 3) == 4 / 9
    assert lru_hit_ratio(requests, 0) == 0.0
    assert lru_hit_ratio([], 3) == 0.0


def test_lru_prefix_rule_a_block_behind_a_miss_is_no_hit() -> None:
    # 2 and 3 are cached when r2 comes, but its first block 9 is not: nothing is served
    assert lru_hit_ratio([[1, 2, 3], [9, 2, 3]], 10) == 0.0
    # and the blocks behind the miss were touched: r3 finds 9 2 3 all cached
    assert lru_hit_ratio([[1, 2, 3], [9, 2, 3], [9, 2, 3]], 10) == 3 / 9


def test_lru_evicts_within_a_request_larger_than_the_cache() -> None:
    # 2 blocks, 1 2 3 twice: inserting 3 evicts 1, and r2 misses 1 at once (the LRU loop)
    assert lru_hit_ratio([[1, 2, 3], [1, 2, 3]], 2) == 0.0


def test_min_counts_every_cached_reference_without_the_prefix_rule() -> None:
    assert min_hit_ratio([[1, 2, 3], [9, 2, 3]], 10) == 2 / 6


def test_min_bypasses_the_block_needed_last() -> None:
    # 2 blocks, stream 1 2 3 1 2 3: 3's next use (5) is farther than 2's (4): 3 is bypassed,
    # 1 and 2 hit; 3 misses again: 2 of 6, where LRU gets 0
    assert min_hit_ratio([[1, 2, 3], [1, 2, 3]], 2) == 2 / 6


def test_min_on_beladys_example() -> None:
    # 3 blocks, 1 2 3 4 1 2 5 1 2 3 4 5: 4 (next at 10) and 5 (next at 11) are bypassed for
    # 3 (next at 9); hits: 1 2 at 4-5, 1 2 3 at 7-9: 5 of 12 (OPT's classic 7 faults)
    assert min_hit_ratio([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 5]], 3) == 5 / 12
    assert min_hit_ratio([[1, 2], [1, 2]], 0) == 0.0
    assert min_hit_ratio([], 3) == 0.0


traces = st.lists(st.lists(st.integers(0, 12), max_size=8), max_size=25)


@FAST
@given(traces, st.integers(0, 14))
def test_min_is_never_below_lru(requests: list[list[int]], capacity: int) -> None:
    assert min_hit_ratio(requests, capacity) >= lru_hit_ratio(requests, capacity)


@FAST
@given(traces, st.integers(0, 14))
def test_min_grows_with_capacity_up_to_every_repeat(requests: list[list[int]], capacity: int
                                                    ) -> None:
    assert min_hit_ratio(requests, capacity) <= min_hit_ratio(requests, capacity + 1)
    references = sum(map(len, requests))
    distinct = len({block for ids in requests for block in ids})
    if references:
        repeats = 1 - distinct / references
        assert min_hit_ratio(requests, distinct) == pytest.approx(repeats)
        assert lru_hit_ratio(requests, capacity) <= repeats + 1e-12


def test_baselines_refuse_a_negative_capacity() -> None:
    with pytest.raises(ValueError):
        lru_hit_ratio([[1]], -1)
    with pytest.raises(ValueError):
        min_hit_ratio([[1]], -1)


# -- capacity points -----------------------------------------------------------------------------
def three_tiers(directory: Path) -> Config:
    return Config(tiers=(
        GpuTierConfig("g", 64 * MiB, "cpu", slot_size=256 * KiB),
        PmemTierConfig("p", 64 * MiB, directory / "pool" / "kv.pool", queue_depth=4),
        NvmeTierConfig("n", 256 * MiB, directory / "log" / "kv.log", region_size=MiB,
                       direct=False),
    ))


def test_capacity_point_splits_resizes_and_cleans_up(tmp_path: Path) -> None:
    (tmp_path / "pool").mkdir()
    (tmp_path / "log").mkdir()
    config = three_tiers(tmp_path)
    total = 100 * MiB
    with capacity_point(config, total, 16 * KiB, ReplayPolicy.TIERKV) as (sized, sizings):
        gpu, pmem, nvme = sized.tiers
        assert isinstance(gpu, GpuTierConfig)
        assert isinstance(pmem, PmemTierConfig)
        assert isinstance(nvme, NvmeTierConfig)
        assert (gpu.capacity, gpu.slot_size, gpu.device) == (20 * MiB, 16 * KiB, "cpu")
        assert (pmem.capacity, pmem.queue_depth, pmem.format) == (int(0.3 * total), 4, True)
        assert (nvme.capacity, nvme.region_size, nvme.format) == (NVME_SUPERBLOCK + 50 * MiB,
                                                                  MiB, True)
        assert pmem.path.parent.parent == tmp_path / "pool"  # a scratch dir beside the config's
        assert nvme.path.parent.parent == tmp_path / "log"
        assert pmem.path.parent.is_dir()
        assert not any(s.raised_to_minimum for s in sizings)
        assert sized.scheduler.policy is EvictionPolicy.LRUPP
        assert sized.scheduler.admission is Admission.PASS_ALL  # the config's default
        assert sized.scheduler.background_bandwidth is None
        scratch = [pmem.path.parent, nvme.path.parent]
    assert not any(directory.exists() for directory in scratch)


def test_small_points_raise_tiers_to_their_minimum(tmp_path: Path) -> None:
    (tmp_path / "pool").mkdir()
    (tmp_path / "log").mkdir()
    with capacity_point(three_tiers(tmp_path), 200 * KiB, 16 * KiB, ReplayPolicy.LRU
                        ) as (sized, sizings):
        assert [s.raised_to_minimum for s in sizings] == [False, True, True]
        assert sized.tiers[1].capacity == MIN_PMEM_POOL
        assert sized.tiers[2].capacity == NVME_SUPERBLOCK + MiB
        assert sized.scheduler.policy is EvictionPolicy.LRU
        assert sized.scheduler.admission is Admission.PASS_ALL


def test_shares_are_renormalised_over_the_kinds_present(tmp_path: Path) -> None:
    gpu, _, nvme = three_tiers(tmp_path).tiers
    assert tier_shares(Config(tiers=(gpu, nvme))) == pytest.approx([0.2 / 0.7, 0.5 / 0.7])
    second = NvmeTierConfig("n2", 256 * MiB, tmp_path / "other.log")
    assert tier_shares(Config(tiers=(nvme, second))) == pytest.approx([0.5, 0.5])


# -- the replay ----------------------------------------------------------------------------------
async def test_prefix_hits_are_counted_up_to_the_first_miss(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[0, 1, 2], [0, 1, 3], [0, 1, 3, 4], [5, 1, 3]])
    clock = TraceClock()
    async with tierkv.open(l1_config(capacity="1MiB", slot_size="1KiB"), clock=clock) as kv:
        counts = await replay_point(kv, list(read_trace(trace)), clock, block_size=100,
                                    phase="t")
        assert clock() == 3.0  # the engine saw the last request's trace time
    # served: 0, then 2 (0,1), then 3 (0,1,3), then 0 (5 is new; 1 and 3 sit behind a miss)
    assert (counts.references, counts.served) == (13, 5)
    # put: 0 1 2, then 3, then 4, then 5; 1 and 3 of the last request were found: not re-put
    assert counts.puts == 6
    assert counts.served_by_tier == {"l1": 5}
    assert kv.stats()["engine"]["hits"] == {"l1": 5 + 2}  # 1 and 3 of the last request hit too
    assert counts.max_objects == 6  # one object per put: nothing was evicted


# -- the command line ----------------------------------------------------------------------------
def small_trace(path: Path, count: int = 80) -> Path:
    rng = random.Random(7)
    prefixes = [[rng.randrange(1 << 40) for _ in range(6)] for _ in range(6)]
    fresh = iter(range(1 << 41, 1 << 42))
    requests = [prefixes[rng.randrange(6)][: rng.randint(1, 6)]
                + [next(fresh) for _ in range(rng.randint(0, 3))] for _ in range(count)]
    return write_trace(path, requests)


@pytest.mark.pmem
def test_cli_replays_a_trace_beside_its_baselines(tmp_path: Path) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(f"""
[[tiers]]
name = "gpu"
kind = "gpu"
device = "cpu"
capacity = "4MiB"
slot_size = "256KiB"

[[tiers]]
name = "pmem"
kind = "pmem"
path = "{tmp_path / "kv.pool"}"
capacity = "8MiB"

[[tiers]]
name = "nvme"
kind = "nvme"
path = "{tmp_path / "kv.log"}"
capacity = "8MiB"
region_size = "1MiB"
direct = false
""")
    out = tmp_path / "bench.json"
    trace = small_trace(tmp_path / "trace.jsonl")
    code = main(["bench", "--config", str(config), "--trace", str(trace), "--capacity", "5%",
                 "--quick", "--json", str(out)])
    assert code == 0
    document = json.loads(out.read_text())
    result = document["results"]["trace"]
    assert result["policy"] == "tierkv"
    assert result["block_size"] == 16 * KiB
    [point] = result["points"]
    assert point["capacity_fraction"] == 0.05
    assert 0 <= point["blocks_served"] <= point["block_references"]
    assert point["block_references"] == result["block_references"]
    assert point["hit_ratio"] == point["blocks_served"] / point["block_references"]
    assert 0 <= point["lru_hit_ratio"] <= point["min_hit_ratio"] <= 1
    assert sum(point["served_by_tier"].values()) == point["blocks_served"]
    assert set(point["tiers"]) == {"gpu", "pmem", "nvme"}
    assert point["tiers"]["pmem"]["raised_to_minimum"]  # 5 % of a small trace: far below 8 MiB
    for key in ("gap_closed", "hits_by_tier_all_found", "written_bytes", "demoted_bytes",
                "promoted_bytes", "max_objects_held", "holdable_blocks", "requests_per_s"):
        assert key in point
    assert "average_gap_closed" in result
    assert any(row["case"].startswith("trace 5%: hit %") for row in document["rows"])
    assert not list(tmp_path.glob("tierkv-trace-*"))  # scratch media deleted


@pytest.mark.parametrize(("option", "value"), [
    ("--capacity", "5"),  # fine: a plain number is a percentage too; the next ones are not
    ("--capacity", "0%"),
    ("--capacity", "5%,abc"),
    ("--capacity", "101%"),
    ("--capacity", "5%,5"),  # replayed twice, its report row twice
    ("--capacity", "1_0%"),  # float() reads 10
    ("--capacity", "1e1%"),
    ("--capacity", ""),
    ("--policy", "fifo"),
    ("--block-size", "lots"),
    ("--block-size", "0"),
])
def test_bad_trace_options_are_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2]])
    missing_config = tmp_path / "absent.toml"  # a good option gets as far as loading it
    code = main(["bench", "--config", str(missing_config), "--trace", str(trace),
                 f"{option}={value}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "Traceback" not in err
    if value != "5":
        assert option in err


def test_a_bad_trace_file_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gpu.toml"
    config.write_text('[[tiers]]\nname = "l1"\nkind = "gpu"\ndevice = "cpu"\n'
                      'capacity = "1MiB"\nslot_size = "64KiB"\n')
    trace = tmp_path / "bad.jsonl"
    trace.write_text("not json\n")
    assert main(["bench", "--config", str(config), "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--trace" in err


@pytest.mark.parametrize("what", KINDS)
def test_a_trace_without_line_ends_is_one_line_and_exit_2(tmp_path: Path, what: str) -> None:
    # --trace naming a pool file or /dev/zero: its first "line" was read whole, a MemoryError
    # traceback (or the OOM killer) instead of a word about the trace
    trace = endless_input(tmp_path, what)
    result = run_capped("bench", "--trace", str(trace), "--quick")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert "--trace" in result.stderr
