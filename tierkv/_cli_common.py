"""What the `tierkv` command's parts share: its console and the config a command runs on."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from tierkv.config import (
    Config,
    NvmeTierConfig,
    PmemTierConfig,
    load_config,
)
from tierkv.config.default import default_config, shm_or
from tierkv.config.machine import media_identity
from tierkv.errors import ConfigError

if TYPE_CHECKING:
    pass

console = Console()
if not console.is_terminal:
    console = Console(width=160)



@contextlib.contextmanager
def config_for(path: Path | None, workdir: Path) -> Iterator[Config]:
    """The config at `path`, or the embedded default with its files in fresh temporary dirs."""
    if path is not None:
        yield load_config(path)
        return
    if not workdir.is_dir():
        raise ConfigError(f"--workdir: {workdir} is not a directory")
    made: list[Path] = []
    try:
        made.append(scratch_dir(workdir))
        made.append(scratch_dir(shm_or(workdir)))
        yield default_config(made[1], made[0])
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)


def scratch_dir(parent: Path) -> Path:
    """A new ``tierkv-*`` directory in `parent` (--workdir, or /dev/shm); `ConfigError` naming
    --workdir where none can be made there (read-only, full, not searchable)."""
    try:
        return Path(tempfile.mkdtemp(prefix="tierkv-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"--workdir: cannot make a directory in {parent}: "
                          f"{exc.strerror or exc}") from None


def refuse_tier_media(option: str, path: Path, config: Config) -> None:
    """`ConfigError` naming `option` where the file it would write at `path` is the media of one
    of `config`'s tiers, under whatever name (a symlink, a hard link, another spelling): the
    write would destroy what the tier holds."""
    target = media_identity(path)
    for index, tier in enumerate(config.tiers):
        if isinstance(tier, PmemTierConfig | NvmeTierConfig) and \
                media_identity(tier.path) == target:
            raise ConfigError(f"{option}: {path} is the {tier.kind.value} media of tier "
                              f"{tier.name!r} (tiers[{index}].path {tier.path}); it would be "
                              "overwritten")
