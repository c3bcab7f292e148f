"""A tier's path that is a symlink names the media where it points: the pool or log is made,
kept and remade at the link's target, and the link stays. A dangling link to a pool was
replaced by a pool in the link's directory (off the mount it pointed to), and a dangling link
to a log failed the open with "No such file or directory"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import tierkv
from tests.engine._configs import hierarchy_config
from tierkv.cli import main


def _round_trip(config: dict[str, object], value: bytes) -> None:
    async def write_then_read() -> None:
        async with tierkv.open(config) as kv:
            await kv.put("k", value)
        async with tierkv.open(config) as kv:
            assert await kv.get("k") == value

    asyncio.run(write_then_read())


def test_a_pool_behind_a_dangling_symlink_is_made_at_its_target(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    mount.mkdir()
    config = hierarchy_config(tmp_path, ("pmem",))
    link = Path(config["tiers"][0]["path"])
    link.symlink_to(mount / "pool")
    _round_trip(config, b"first")
    assert link.is_symlink() and (mount / "pool").stat().st_size > 0
    assert not list(tmp_path.glob("*.creating"))
    # `tierkv format` empties the target; the next open makes the pool there again
    toml = tmp_path / "devices.toml"
    toml.write_text(f'[[tiers]]\nname = "pmem"\nkind = "pmem"\ncapacity = "8MiB"\n'
                    f'path = "{link}"\n')
    assert main(["format", "--config", str(toml), "--yes"]) == 0
    assert (mount / "pool").stat().st_size == 0
    _round_trip(config, b"second")
    assert link.is_symlink() and (mount / "pool").stat().st_size > 0


def test_a_log_behind_a_dangling_symlink_is_made_at_its_target(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    mount.mkdir()
    config = hierarchy_config(tmp_path, ("nvme",))
    link = Path(config["tiers"][0]["path"])
    link.symlink_to(mount / "log")
    _round_trip(config, b"logged")
    assert link.is_symlink() and (mount / "log").stat().st_size > 0
