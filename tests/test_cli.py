"""The `tierkv` command line: info, bench, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.cli import main

GPU_ONLY = """
[[tiers]]
name = "l1"
kind = "gpu"
device = "cpu"
capacity = "64MiB"
slot_size = "2MiB"
"""


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierkv.cli", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )


def test_config_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(GPU_ONLY + 'bogus = "x"\n')
    result = run_cli("info", "--config", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert "tiers[0].bogus" in result.stderr


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    result = run_cli("bench", "--config", str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_info_prints_each_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    assert main(["info", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "tiers[0] l1" in out
    assert "device: cpu" in out
    assert "io_uring" in out


def test_bench_gpu_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    out_file = tmp_path / "bench.json"
    code = main(["bench", "--config", str(config), "--device", "gpu", "--quick",
                 "--json", str(out_file)])
    assert code == 0
    document = json.loads(out_file.read_text())
    cases = [row["case"] for row in document["rows"]]
    assert any("L1 get hit 4KiB p50" in case for case in cases)
    assert any("2MiB tensor" in case for case in cases)
    for row in document["rows"]:
        assert row["measured"] > 0
    assert document["results"]["l1_get_4k"]["gets_per_s"] > 0


def test_info_names_the_pmem_copy_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(f'[[tiers]]\nkind = "pmem"\nname = "l2"\ncapacity = "64MiB"\n'
                      f'path = "{tmp_path / "l2.pool"}"\n')
    assert main(["info", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "copies: native (pmem_copy" in out  # scripts/setup builds the library
    assert not (tmp_path / "l2.pool").exists()  # info creates nothing
