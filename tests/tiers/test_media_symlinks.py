"""A tier's path that is a symlink names the media where it points: the pool or log is made,
kept and remade at the link's target, and the link stays. A dangling link to a pool was
replaced by a pool in the link's directory (off the mount it pointed to), and a dangling link
to a log failed the open with "No such file or directory"."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import tierkv
from tests.engine._configs import hierarchy_config
from tierkv.cli import main


def _round_trip(config: dict[str, Any], value: bytes) -> None:
    async def write_then_read() -> None:
        async with tierkv.open(config) as kv:
            await kv.put("k", value)
        async with tierkv.open(config) as kv:
            assert await kv.get("k") == value

    asyncio.run(write_then_read())


def _linked(tmp_path: Path, kind: str) -> tuple[dict[str, Any], Path, Path]:
    """A config of one `kind` tier whose path is a dangling symlink; the link and its target
    (in another directory, as on another mount)."""
    mount = tmp_path / "mount"
    mount.mkdir()
    config = hierarchy_config(tmp_path, (kind,))
    link = Path(config["tiers"][0]["path"])
    link.symlink_to(mount / kind)
    return config, link, mount / kind


def test_a_pool_behind_a_dangling_symlink_is_made_at_its_target(tmp_path: Path) -> None:
    config, link, target = _linked(tmp_path, "pmem")
    _round_trip(config, b"first")
    assert link.is_symlink() and target.stat().st_size > 0
    assert not list(tmp_path.glob("*.creating"))
    # `tierkv format` empties the target; the next open makes the pool there again
    toml = tmp_path / "devices.toml"
    toml.write_text(f'[[tiers]]\nname = "pmem"\nkind = "pmem"\ncapacity = "8MiB"\n'
                    f'path = "{link}"\n')
    assert main(["format", "--config", str(toml), "--yes"]) == 0
    assert target.stat().st_size == 0
    _round_trip(config, b"second")
    assert link.is_symlink() and target.stat().st_size > 0


def test_a_log_behind_a_dangling_symlink_is_made_at_its_target(tmp_path: Path) -> None:
    config, link, target = _linked(tmp_path, "nvme")
    _round_trip(config, b"logged")
    assert link.is_symlink() and target.stat().st_size > 0
