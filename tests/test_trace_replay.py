"""The trace replay benchmark counts hits under prefix semantics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierkv
from tests.engine.conftest import l1_config
from tierkv.bench.trace import block_key, read_trace, replay


def write_trace(path: Path, requests: list[list[int]]) -> None:
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                    "hash_ids": ids}) + "\n"
        for i, ids in enumerate(requests)
    ))


async def test_prefix_hits_are_counted_up_to_the_first_miss(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, [[0, 1, 2], [0, 1, 3], [0, 1, 3, 4], [5, 1, 3]])
    async with tierkv.open(l1_config(capacity="1MiB", slot_size="1KiB")) as kv:
        result, rows = await replay(kv, list(read_trace(trace)), block_bytes=100)
    # served: 0, then 2 (0,1), then 3 (0,1,3), then 0 (5 is new; 1 and 3 sit behind a miss)
    assert result["block_references"] == 13
    assert result["blocks_served"] == 5
    assert result["blocks_put"] == 8
    assert result["hits_by_tier"] == {"l1": 5 + 2}  # 1 and 3 of the last request hit too
    assert rows[0].measured == pytest.approx(5 / 13)


def test_keys_depend_on_position_and_id() -> None:
    assert block_key(7, 0) == block_key(7, 0)
    assert block_key(7, 0) != block_key(7, 1)
    assert block_key(7, 0).digest != block_key(8, 0).digest


def test_bad_trace_line_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": "nope"}\n')
    with pytest.raises(ValueError) as caught:
        list(read_trace(trace))
    assert f"{trace}:2" in str(caught.value)  # the message names the line: that is the point


def test_cli_refuses_a_bad_trace_in_one_line(tmp_path: Path) -> None:
    from tests.test_cli import run_cli

    trace = tmp_path / "bad.jsonl"
    trace.write_text("not json\n")
    result = run_cli("bench", "--device", "gpu", "--quick", "--trace", str(trace))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
