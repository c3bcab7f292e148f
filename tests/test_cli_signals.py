"""SIGTERM ends a command as Ctrl-C does: the command's clean-up runs (the scratch media of
`tierkv bench`: pools on /dev/shm are RAM), and the CLI exits 143 (130); signals after the
first change nothing."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._three_tiers import three_tier_toml
from tierkv._cli_signals import EXIT_TERMINATED, Terminated, run, terminable


def test_sigterm_cancels_the_running_command_and_its_clean_up_runs() -> None:
    cleaned: list[str] = []

    async def command() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        finally:
            cleaned.append("async")

    with pytest.raises(Terminated), terminable():
        try:
            run(command())
        finally:
            cleaned.append("sync")
    assert cleaned == ["async", "sync"]
    assert signal.getsignal(signal.SIGTERM) is not signal.getsignal(signal.SIGINT)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_later_signals_raise_nowhere_while_the_clean_up_runs(signum: signal.Signals) -> None:
    cleaned: list[str] = []

    async def command() -> None:
        try:
            os.kill(os.getpid(), signum)
            await asyncio.sleep(30)
        finally:
            for again in (signal.SIGINT, signal.SIGTERM, signum):
                os.kill(os.getpid(), again)
                await asyncio.sleep(0.05)
            cleaned.append("async")

    with pytest.raises(Terminated) as raised, terminable():
        try:
            run(command())
        finally:
            os.kill(os.getpid(), signum)
            cleaned.append("sync")
    assert cleaned == ["async", "sync"]
    assert raised.value.exit_status == 128 + signum


def test_sigterm_between_runs_unwinds_too() -> None:
    with pytest.raises(Terminated), terminable():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_starts_ends_it_quietly(tmp_path: Path,
                                                           signum: signal.Signals) -> None:
    """Early on, the command is still importing (torch: seconds); later it serves. Wherever the
    signal lands, the process ends at once and prints no traceback: with 128 + the signal, or
    with 0 where it reached the serving (documented: it serves until a signal, then exits 0),
    which it says by printing its URL first."""
    config = tmp_path / "devices.toml"
    config.write_text('[[tiers]]\nname = "l1"\nkind = "gpu"\ndevice = "cpu"\n'
                      'capacity = "64KiB"\nslot_size = "4KiB"\n')
    for delay in (0.3, 0.8, 1.5):
        process = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "serve-metrics", "--config", str(config),
             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(delay)
            process.send_signal(signum)
            stdout, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        served = "serving metrics on http://" in stdout
        assert process.returncode == (0 if served else 128 + signum), (delay, stderr)
        assert "Traceback" not in stderr, (delay, stderr)


def _trace(path: Path, requests: int) -> Path:
    rng = random.Random(3)
    lines = []
    for i in range(requests):
        ids = [rng.randrange(requests // 4) for _ in range(rng.randrange(1, 12))]
        lines.append(json.dumps({"timestamp": i * 100, "input_length": 512 * len(ids),
                                 "output_length": 1, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _replaying(tmp_path: Path, errors: Path) -> subprocess.Popen[bytes]:
    """`tierkv bench --trace` of a long trace on the three tiers under `tmp_path`, once it has
    made its scratch media and replays."""
    config = tmp_path / "devices.toml"
    config.write_text(three_tier_toml(tmp_path))
    trace = _trace(tmp_path / "trace.jsonl", 200_000)
    with errors.open("w") as stderr:
        bench = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "bench", "--config", str(config), "--trace",
             str(trace), "--capacity", "25%", "--block-size", "4KiB"],
            stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "log").glob("tierkv-trace-*/*")):  # its scratch log is made
            assert bench.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, "the replay never made its scratch media"
            time.sleep(0.05)
        time.sleep(0.5)  # replaying
        assert bench.poll() is None, "the replay ended before it could be signalled"
    except BaseException:
        bench.kill()
        bench.wait()
        raise
    return bench


def _scratch_left(tmp_path: Path) -> list[Path]:
    return [path for directory in ("pool", "log")
            for path in (tmp_path / directory).glob("tierkv-trace-*")]


@pytest.mark.pmem
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_repeated_signals_end_a_trace_replay_once(tmp_path: Path, signum: signal.Signals) -> None:
    """A second Ctrl-C or SIGTERM while the replay winds down once raised in a background move
    or hung the clean-up (SIGKILL needed, scratch media left behind)."""
    errors = tmp_path / "stderr"
    bench = _replaying(tmp_path, errors)
    try:
        bench.send_signal(signum)
        for _ in range(10):  # while it takes down its engine and scratch media
            time.sleep(0.1)
            if bench.poll() is not None:
                break
            bench.send_signal(signum)
        assert bench.wait(timeout=60) == 128 + signum
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    said = errors.read_text()
    assert "Traceback" not in said
    assert f"tierkv: terminated by {signal.Signals(signum).name}" in said  # it said nothing
    assert not _scratch_left(tmp_path)


@pytest.mark.pmem
def test_a_terminated_trace_replay_leaves_no_scratch_media(tmp_path: Path) -> None:
    bench = _replaying(tmp_path, tmp_path / "stderr")
    try:
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == EXIT_TERMINATED
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert not _scratch_left(tmp_path)


def _children_named(pid: int, name: str) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            command = fields[0].split("(", 1)[1]
            parent = int(fields[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and command == name:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_a_signal_while_fio_runs_leaves_no_scratch_file(tmp_path: Path) -> None:
    """`bench --device nvme` runs fio (its baseline) from a thread; a Ctrl-C while fio ran
    removed the scratch directory while fio went on writing its file, which fio made again:
    a file of 256 MiB was left behind, in 4 runs of 6."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:
        bench = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "bench", "--device", "nvme", "--quick",
             "--workdir", str(workdir)], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        seen: set[int] = set()
        while len(seen) < 2:  # the second fio: the first fills the file the tier runs read
            seen.update(_children_named(bench.pid, "fio"))
            assert bench.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, "the bench never ran fio twice"
            time.sleep(0.02)
        time.sleep(0.5)  # fio writes
        bench.send_signal(signal.SIGINT)
        assert bench.wait(timeout=60) == 130
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert "Traceback" not in errors.read_text()
    assert list(workdir.iterdir()) == []


def test_a_ctrl_c_while_the_recovery_bench_fills_ends_it_quietly(tmp_path: Path) -> None:
    """A Ctrl-C (SIGINT to the process group, as a terminal sends it) while the recovery
    bench's writer process fills the tiers: the writer got it too and died with a traceback,
    the bench then failed with one of its own ("the writer stopped early", exit 1). The bench
    ends as terminated (130), the writer with it, and prints no traceback."""
    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:
        bench = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "bench", "--device", "recovery", "--quick",
             "--workdir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        writers: list[int] = []
        while not writers:
            writers = [pid for name in ("python", "python3", "python3.11")
                       for pid in _children_named(bench.pid, name)]
            assert bench.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, "the bench never started its writer"
            time.sleep(0.02)
        time.sleep(0.5)  # the writer fills
        os.killpg(bench.pid, signal.SIGINT)
        assert bench.wait(timeout=60) == 130, errors.read_text()
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert "Traceback" not in errors.read_text()
    assert not any(Path(f"/proc/{pid}").exists() for pid in writers)
