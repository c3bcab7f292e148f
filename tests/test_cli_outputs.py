"""A file a `tierkv` option writes is never the media of one of the config's tiers: refused
(one line, exit 2) before anything runs, however the option names it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tierkv.cli import main

CONFIG = """
[[tiers]]
name = "l1"
kind = "gpu"
device = "cpu"
capacity = "8MiB"
slot_size = "64KiB"

[[tiers]]
name = "l2"
kind = "pmem"
capacity = "8MiB"
path = "l2.pool"

[[tiers]]
name = "l3"
kind = "nvme"
capacity = "5MiB"
region_size = "1MiB"
direct = false
backend = "threads"
path = "l3.log"
"""
#: what the tiers' files hold before the command: a stand-in for what a user stored
HELD = b"what the tier holds"


def _as_written(media: Path) -> Path:
    return media


def _relative(media: Path) -> Path:
    os.chdir(media.parent)  # undone by the test's monkeypatch.chdir
    return Path(media.name)


def _symlink(media: Path) -> Path:
    (media.parent / "results.json").symlink_to(media)
    return media.parent / "results.json"


def _hard_link(media: Path) -> Path:
    (media.parent / "results.json").hardlink_to(media)
    return media.parent / "results.json"


SPELLINGS: dict[str, Callable[[Path], Path]] = {
    "as-written": _as_written, "relative": _relative, "symlink": _symlink,
    "hard-link": _hard_link,
}


@pytest.mark.parametrize("tier", ["l2", "l3"])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_bench_json_on_a_tiers_file_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    spelling: str, tier: str
) -> None:
    # the results were written over the pool or log once the run was done: all it held lost
    monkeypatch.chdir(tmp_path)
    (tmp_path / "etc").mkdir()
    config = tmp_path / "etc" / "devices.toml"
    config.write_text(CONFIG)
    media = {"l2": tmp_path / "etc" / "l2.pool", "l3": tmp_path / "etc" / "l3.log"}
    for path in media.values():
        path.write_bytes(HELD)
    target = SPELLINGS[spelling](media[tier])
    code = main(["bench", "--config", str(config), "--device", "gpu", "--quick",
                 "--json", str(target)])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.count("\n") == 1
    assert "--json" in captured.err and repr(tier) in captured.err
    assert "tierkv bench" not in captured.out  # the table of a run
    assert all(path.read_bytes() == HELD for path in media.values())


def test_bench_json_beside_the_tiers_files_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(CONFIG.replace('path = "', f'path = "{tmp_path}/'))
    out = tmp_path / "l2.pool.json"
    assert main(["bench", "--config", str(config), "--device", "scheduler", "--quick",
                 "--json", str(out)]) == 0, capsys.readouterr().err
    assert out.read_text().startswith("{")


@pytest.mark.parametrize("option", ["--config", "--trace"])
def test_bench_json_on_the_runs_own_config_or_trace_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    # the results were written over the file the run had been asked to read
    config = tmp_path / "devices.toml"
    config.write_text(CONFIG.replace('path = "', f'path = "{tmp_path}/'))
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n')
    inputs = {"--config": config, "--trace": trace}
    before = {path: path.read_bytes() for path in inputs.values()}
    (tmp_path / "link.json").symlink_to(inputs[option])
    argv = ["bench", "--config", str(config), "--quick", "--json", str(tmp_path / "link.json")]
    if option == "--trace":
        argv += ["--trace", str(trace)]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.count("\n") == 1 and "--json" in captured.err and option in captured.err
    assert {path: path.read_bytes() for path in inputs.values()} == before
