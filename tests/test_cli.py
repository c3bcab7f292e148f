"""The `tierkv` command line: info, bench, format, and one-line errors with exit code 2."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tierkv
from tests._endless import KINDS, endless_input, run_capped
from tierkv.cli import main
from tierkv.config import Config, TierConfig, load_config
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.testing.redis_server import RedisServer
from tierkv.tiers.registry import make_tier

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


@pytest.mark.skipif(Path("/mnt/pmem0").exists(), reason="this machine has the example's mount")
def test_info_on_the_example_without_its_mounts_names_the_missing_directory() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "devices.toml"
    result = run_cli("info", "--config", str(example))
    assert_one_line(result, 2)
    assert "tiers[1].path: directory /mnt/pmem0 does not exist" in result.stderr


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    result = run_cli("bench", "--config", str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("what", KINDS)
def test_a_config_that_is_no_config_file_but_endless_or_huge_is_a_config_error(
    tmp_path: Path, what: str
) -> None:
    # --config on a pool or log file (tab completion) or on a character device was read whole:
    # a MemoryError traceback, or the OOM killer, before any word about the config
    config = endless_input(tmp_path, what)
    result = run_capped("info", "--config", str(config))
    assert_one_line(result, 2)
    assert str(config) in result.stderr


def test_a_bench_config_error_prints_only_its_line(tmp_path: Path) -> None:
    # the progress bar was started before the config was checked: a blank line on stdout
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY + '\n[[tiers]]\nname = "l3"\nkind = "nvme"\ncapacity = "8MiB"\n'
                      f'region_size = "1MiB"\npath = "{tmp_path / "absent" / "l3.log"}"\n')
    result = run_cli("bench", "--config", str(config))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.count("\n") == 1 and "tiers[1].path" in result.stderr


def test_info_prints_each_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    assert main(["info", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "tiers[0] l1" in out
    assert "device: cpu" in out
    assert "io_uring" in out


@pytest.mark.redis
def test_info_of_a_redis_tier_writes_nothing_to_the_server(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_server: RedisServer,
        redis_url: str) -> None:
    # it opened the tier, whose survey of the fleet's log set the log's epoch on the server
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY + f'[[tiers]]\nname = "shared"\nkind = "redis"\n'
                                 f'url = "{redis_url}"\ncapacity = "16MiB"\n')
    assert main(["info", "--config", str(config)]) == 0
    assert "reachable: yes" in capsys.readouterr().out
    assert redis_server.command("DBSIZE") == 0


@pytest.mark.parametrize("where", ['url = "redis://127.0.0.1:1/0"', 'cluster = ["127.0.0.1:1"]'],
                         ids=["standalone", "cluster"])
def test_a_shared_tier_that_cannot_be_reached_is_one_line(tmp_path: Path, where: str) -> None:
    """`info` says it is not reachable, `serve-metrics` refuses in one line: a cluster's
    connection error is no `RedisError` (redis-py), and both printed a traceback of ~100 lines."""
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY + f'[[tiers]]\nname = "shared"\nkind = "redis"\n{where}\n'
                                 'capacity = "16MiB"\n')
    info = run_cli("info", "--config", str(config))
    assert info.returncode == 0 and "Traceback" not in info.stderr, info.stderr
    assert "reachable: no" in info.stdout
    serve = run_cli("serve-metrics", "--config", str(config), "--port", "0")
    assert_one_line(serve, 1)
    assert "redis tier 'shared'" in serve.stderr


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
    assert "records out of the garbage collector's sight: native" in out  # and the module
    assert not (tmp_path / "l2.pool").exists()  # info creates nothing


def test_info_says_what_the_next_open_finds_in_the_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "l3.log"
    config = tmp_path / "devices.toml"

    def info(capacity: str) -> str:
        config.write_text(f'[[tiers]]\nkind = "nvme"\nname = "l3"\ncapacity = "{capacity}"\n'
                          f'region_size = "1MiB"\npath = "{log}"\n')
        assert main(["info", "--config", str(config)]) == 0
        [line] = [line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("  log: ")]
        return line

    assert "none yet" in info("16MiB") and not log.exists()  # info creates nothing
    asyncio.run(_put_one(load_config(config)))
    assert "a tierkv log of 15 regions of 1MiB" in (found := info("16MiB"))
    assert "recovered at open" in found

    async def info_while_open() -> str:
        async with tierkv.open(load_config(config)):
            return info("16MiB")

    held = asyncio.run(info_while_open())
    assert f"in use (held by this process (pid {os.getpid()})); an open is refused" in held
    assert "asks for 7 regions of 1MiB; the next open refuses it" in info("8MiB")
    log.write_bytes(b"\0" * 8192)
    assert "a zeroed superblock; the next open refuses it" in info("16MiB")
    log.write_bytes(b"not a log" * 1000)
    assert "no tierkv log" in info("16MiB")


def test_info_says_when_a_pool_is_smaller_than_its_capacity_makes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pool = tmp_path / "l2.pool"
    config = tmp_path / "devices.toml"
    config.write_text(f'[[tiers]]\nkind = "pmem"\nname = "l2"\ncapacity = "8MiB"\n'
                      f'path = "{pool}"\n')

    def info() -> str:
        assert main(["info", "--config", str(config)]) == 0
        [line] = [line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("  pool: ")]
        return line

    asyncio.run(_put_one(load_config(config)))
    assert "tierkv pool" in (whole := info()) and "truncated" not in whole
    with pool.open("r+b") as file:  # a copy that stopped half way: the header says tierkv
        file.truncate(pool.stat().st_size // 2)
    assert "made for a smaller capacity, or truncated" in info()


async def _put_one(config: Config) -> None:
    async with tierkv.open(config) as kv:
        await kv.put("k", b"v")


# -- format --------------------------------------------------------------------------------------
PERSISTENT = GPU_ONLY + """
[[tiers]]
name = "l2"
kind = "pmem"
capacity = "8MiB"
path = "{dir}/l2.pool"

[[tiers]]
name = "l3"
kind = "nvme"
capacity = "5MiB"
region_size = "1MiB"
direct = false
backend = "threads"
path = "{dir}/l3.log"
"""
KEY = b"\x02cli-kept"


def persistent_config(tmp_path: Path) -> tuple[Path, Config]:
    path = tmp_path / "devices.toml"
    path.write_text(PERSISTENT.format(dir=tmp_path))
    return path, load_config(path)


def tier_named(config: Config, name: str) -> TierConfig:
    return next(tier for tier in config.tiers if tier.name == name)


async def fill(config: Config) -> None:
    """One object in each persistent tier (`KEY`), closed again."""
    for name in ("l2", "l3"):
        tier = make_tier(tier_named(config, name))
        await tier.open()
        try:
            await tier.put(KEY, ObjectMeta(ValueKind.BYTES, "", (), 4, 1), b"kept")
        finally:
            await tier.close()


async def held_keys(config: Config, name: str) -> list[bytes]:
    """What the tier finds at open (with the config's own `format = false`)."""
    tier = make_tier(tier_named(config, name))
    recovered = await tier.open()
    try:
        assert sorted(tier.keys()) == sorted(r.key for r in recovered)
        return [r.key for r in recovered]
    finally:
        await tier.close()


def digests(tmp_path: Path) -> dict[str, str]:
    return {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
            for name in ("l2.pool", "l3.log")}


def assert_one_line(result: subprocess.CompletedProcess[str], code: int) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.pmem
async def test_format_without_yes_names_the_tiers_and_changes_nothing(tmp_path: Path) -> None:
    path, config = persistent_config(tmp_path)
    await fill(config)
    before = digests(tmp_path)
    result = run_cli("format", "--config", str(path))
    assert_one_line(result, 2)
    assert "l2" in result.stderr and "l3" in result.stderr and "l1" not in result.stderr
    assert digests(tmp_path) == before


@pytest.mark.pmem
async def test_format_yes_wipes_every_persistent_tier(tmp_path: Path) -> None:
    path, config = persistent_config(tmp_path)
    await fill(config)
    result = run_cli("format", "--config", str(path), "--yes")
    assert result.returncode == 0, result.stderr
    assert await held_keys(config, "l2") == []
    assert await held_keys(config, "l3") == []


@pytest.mark.pmem
async def test_format_tier_picks_one(tmp_path: Path) -> None:
    path, config = persistent_config(tmp_path)
    await fill(config)
    result = run_cli("format", "--config", str(path), "--tier", "l3", "--yes")
    assert result.returncode == 0, result.stderr
    assert await held_keys(config, "l3") == []
    assert await held_keys(config, "l2") == [KEY]


@pytest.mark.parametrize("name", ["nope", "l1"], ids=["unknown", "volatile"])
def test_format_of_a_tier_it_cannot_wipe_is_a_config_error(tmp_path: Path, name: str) -> None:
    path, _config = persistent_config(tmp_path)
    result = run_cli("format", "--config", str(path), "--tier", name, "--yes")
    assert_one_line(result, 2)
    assert not (tmp_path / "l2.pool").exists() and not (tmp_path / "l3.log").exists()


@pytest.mark.pmem
async def test_format_refuses_a_pool_held_open(tmp_path: Path) -> None:
    """PMDK's flock on an open pool: the wipe is a device error (exit 1) and the pool is kept."""
    path, config = persistent_config(tmp_path)
    await fill(config)
    holder = make_tier(tier_named(config, "l2"))
    await holder.open()
    try:
        result = run_cli("format", "--config", str(path), "--tier", "l2", "--yes")
        assert_one_line(result, 1)
        assert await holder.contains(KEY)
    finally:
        await holder.close()
    assert await held_keys(config, "l2") == [KEY]


# -- options refused before anything runs ---------------------------------------------------------
@pytest.mark.parametrize(("option", "value"), [("--count", "0"), ("--size", "0"),
                                                ("--concurrency", "-3")])
def test_bench_refuses_a_count_size_or_concurrency_that_is_not_positive(
    tmp_path: Path, option: str, value: str
) -> None:
    # these ran: rows of 0 objects, a p50 of nan, and NaN (not JSON) in --json
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    result = run_cli("bench", "--config", str(config), option, value)
    assert_one_line(result, 2)
    assert option in result.stderr


@pytest.mark.parametrize(("extra", "named"), [
    (["--policy", "lru"], "--policy"),
    (["--capacity", "5%"], "--capacity"),
    (["--block-size", "4KiB"], "--block-size"),
    (["--seed", "3"], "--seed"),
    (["--trace", "{trace}", "--faults", "pmem:eio=0.1"], "--faults"),
    (["--trace", "{trace}", "--device", "nvme"], "--device"),
    (["--trace", "{trace}", "--url", "redis://127.0.0.1:1/0"], "--url"),
    # the workload's options, where no workload runs
    (["--device", "gpu", "--size", "99999TiB"], "--size"),
    (["--device", "nvme", "--count", "10"], "--count"),
    (["--trace", "{trace}", "--concurrency", "4"], "--concurrency"),
])
def test_bench_refuses_an_option_the_run_would_ignore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    # each was ignored: the figures of another run were taken for what it asked (--policy lru
    # measured LRU++, --faults beside --trace injected nothing)
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n')
    device = [] if "--trace" in extra else ["--device", "gpu"]
    args = [arg.format(trace=trace) for arg in extra]
    assert main(["bench", "--config", str(config), "--quick", *device, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_bench_refuses_a_size_no_tier_can_hold_before_any_case_runs(tmp_path: Path) -> None:
    # the workload, the engine bench's last case, refused it after every case before it ran:
    # minutes of figures lost
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    result = run_cli("bench", "--config", str(config), "--size", "1GiB")
    assert_one_line(result, 2)
    assert "--size" in result.stderr and "l1" in result.stderr


def test_bench_sized_beyond_the_memory_is_one_line(tmp_path: Path) -> None:
    # the soak sized its hierarchy for values of up to a TiB: a MemoryError traceback
    result = run_capped("bench", "--faults", "", "--size", "1TiB", "--count", "4", "--quick",
                        "--workdir", str(tmp_path))
    assert_one_line(result, 1)
    assert "out of memory" in result.stderr
    assert list(tmp_path.iterdir()) == []  # its scratch media removed


def test_bench_refuses_a_json_path_it_cannot_write_before_the_run(tmp_path: Path) -> None:
    # it ran the whole bench, then crashed writing the results
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    # /proc: permission bits say yes to root, the file system says no
    for target in (tmp_path / "missing" / "out.json", tmp_path, Path("/proc/tierkv.json")):
        result = run_cli("bench", "--config", str(config), "--device", "gpu",
                         "--json", str(target))
        assert_one_line(result, 2)
        assert "--json" in result.stderr
        assert "tierkv bench" not in result.stdout  # the table of a run


def test_bench_json_check_leaves_no_file_behind(tmp_path: Path) -> None:
    """The check creates the file to be sure it can; a run refused after it leaves none."""
    target = tmp_path / "out.json"
    empty = tmp_path / "trace.jsonl"
    empty.write_text("")
    result = run_cli("bench", "--trace", str(empty), "--json", str(target))
    assert_one_line(result, 2)
    assert "holds no request" in result.stderr  # refused after the check
    assert not target.exists()


def test_bench_json_has_null_where_a_figure_is_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierkv import _cli_bench
    from tierkv.bench.common import Row

    async def nothing_measured(bar: object) -> tuple[dict[str, object], list[Row]]:
        return {"p50": math.nan, "rates": [math.inf, 1.0]}, [Row("empty", "us", math.nan)]

    monkeypatch.setattr(_cli_bench, "_bench_jobs", lambda *_: [("empty", nothing_measured)])
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    out_file = tmp_path / "bench.json"
    assert main(["bench", "--config", str(config), "--json", str(out_file)]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    document = json.loads(out_file.read_text(), parse_constant=refuse)
    assert document["results"]["empty"] == {"p50": None, "rates": [None, 1.0]}
    assert document["rows"][0]["measured"] is None


@pytest.mark.pmem
def test_bench_on_a_config_leaves_what_its_media_hold_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the workload case ran on the config's own pool and log: its objects evicted what a user
    # had stored there, down and out of the last tier, and stayed behind in it
    from tierkv import _cli_bench

    path, config = persistent_config(tmp_path)
    values = {b"user-%d" % i: bytes([i]) * 100_000 for i in range(24)}

    async def store() -> None:
        async with tierkv.open(config) as kv:
            for key, value in values.items():
                await kv.put(key, value)

    async def held() -> dict[bytes, object]:
        async with tierkv.open(config) as kv:
            assert not await kv.contains(b"w-65536-0")  # the workload's first key
            return {key: await kv.get(key) for key in values}

    asyncio.run(store())
    media = sorted(tmp_path.iterdir())
    jobs = _cli_bench._bench_jobs
    monkeypatch.setattr(_cli_bench, "_bench_jobs", lambda *args: [
        (name, job) for name, job in jobs(*args) if name == "workload"])
    assert main(["bench", "--config", str(path), "--count", "256", "--size", "64KiB"]) == 0
    assert sorted(tmp_path.iterdir()) == media  # its scratch media removed
    assert asyncio.run(held()) == values


def test_bench_workdir_where_no_directory_can_be_made_is_a_config_error() -> None:
    # /proc takes no new directory, root or not: mkdtemp's OSError was a traceback
    result = run_cli("bench", "--workdir", "/proc", "--device", "gpu", "--quick")
    assert_one_line(result, 2)
    assert "--workdir" in result.stderr


def test_serve_metrics_refuses_a_port_out_of_range(tmp_path: Path) -> None:
    # 70000 reached the server: an OverflowError traceback
    config = tmp_path / "devices.toml"
    config.write_text(GPU_ONLY)
    for port in ("70000", "-1"):
        result = run_cli("serve-metrics", "--config", str(config), "--port", port)
        assert_one_line(result, 2)
        assert "--port" in result.stderr


def test_serve_metrics_on_a_port_in_use_opens_no_media(tmp_path: Path) -> None:
    """The address is bound before the engine opens: refused after the open, a port in use had
    run recovery and rewritten the pool and the log for nothing (here: made the log)."""
    config = tmp_path / "devices.toml"
    log = tmp_path / "tierkv.log"
    config.write_text(GPU_ONLY + f'\n[[tiers]]\nname = "nvme"\nkind = "nvme"\npath = "{log}"\n'
                      'capacity = "16MiB"\nregion_size = "1MiB"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve-metrics", "--config", str(config), "--port", str(port))
    assert_one_line(result, 2)
    assert "cannot serve metrics" in result.stderr
    assert not log.exists()
