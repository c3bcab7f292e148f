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
    load_config,
)
from tierkv.config.default import default_config, shm_or
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
