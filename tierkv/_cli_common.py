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
    nvme_dir = Path(tempfile.mkdtemp(prefix="tierkv-", dir=workdir))
    pmem_dir = Path(tempfile.mkdtemp(prefix="tierkv-", dir=shm_or(workdir)))
    try:
        yield default_config(pmem_dir, nvme_dir)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
        shutil.rmtree(pmem_dir, ignore_errors=True)
