"""`tierkv format` of every persistent tier: all or none where one cannot be wiped, and one
message naming what was wiped where a wipe fails part way."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import tierkv
from tests.test_cli import KEY, assert_one_line, fill, held_keys, persistent_config, run_cli
from tests.test_cli import tier_named as named
from tierkv.cli import main
from tierkv.tiers.registry import make_tier

pytestmark = pytest.mark.pmem


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


#: an engine on the log alone, in a process of its own, open until it is killed
ENGINE_ON_THE_LOG = """
import asyncio, sys
import tierkv

async def main():
    async with tierkv.open(sys.argv[1]):
        print("OPEN", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def engine_process(config: Path) -> AsyncIterator[None]:
    """An engine open on `config` in another process while the block runs; killed after."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ENGINE_ON_THE_LOG, str(config), stdout=asyncio.subprocess.PIPE)
    try:
        assert process.stdout is not None
        assert await asyncio.wait_for(process.stdout.readline(), 60) == b"OPEN\n"
        yield
    finally:
        process.kill()
        await process.wait()


@pytest.mark.parametrize("holder", ["tier", "engine-in-another-process"])
async def test_a_tier_held_open_leaves_every_tier_as_it_was(tmp_path: Path, holder: str) -> None:
    """The log after the pool in the config, held open (its flock) by its tier here or by an
    engine in another process: the pool before it is not wiped either, and the one line says
    which tier stopped it and that no other was wiped."""
    path, config = persistent_config(tmp_path)
    await fill(config)
    pool = digest(tmp_path / "l2.pool")
    async with contextlib.AsyncExitStack() as held:
        if holder == "tier":
            tier = make_tier(named(config, "l3"))
            await tier.open()
            held.push_async_callback(tier.close)
        else:
            alone = tmp_path / "log-alone.toml"  # the config less its pool
            blocks = path.read_text().split("[[tiers]]")
            alone.write_text("[[tiers]]".join(b for b in blocks if 'name = "l2"' not in b))
            await held.enter_async_context(engine_process(alone))
        result = await asyncio.to_thread(run_cli, "format", "--config", str(path), "--yes")
    assert digest(tmp_path / "l2.pool") == pool  # it was wiped before the log was refused
    assert await held_keys(config, "l2") == [KEY]
    assert_one_line(result, 1)
    assert "tier 'l3'" in result.stderr and "nor was any other (l2)" in result.stderr
    assert result.stdout == ""


async def test_a_wipe_failing_part_way_names_what_was_wiped_and_the_next_open_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every tier taken, then the log's truncation fails (a failing device): the message names
    the pool as wiped and the log as not; the next open takes both, the pool new and the log
    with what it holds (each tier's record of the sessions agrees)."""
    path, config = persistent_config(tmp_path)
    async with tierkv.open(config):
        pass  # each tier gets its record of the sessions it took part in
    await fill(config)
    truncate = os.ftruncate

    def failing(fd: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "l3.log"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        truncate(fd, length)

    monkeypatch.setattr(os, "ftruncate", failing)
    assert main(["format", "--config", str(path), "--yes"]) == 1
    monkeypatch.undo()
    said = capsys.readouterr().err
    assert said.count("\n") == 1
    assert said.startswith("tierkv: error: tier 'l3': ")
    assert f"wiped before it: l2 ({tmp_path / 'l2.pool'}); not reached: none" in said
    assert await held_keys(config, "l2") == []
    async with tierkv.open(config) as kv:
        assert await kv.get(KEY[1:]) == b"kept"  # from the log, as it was
