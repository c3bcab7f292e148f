"""The embedded default configuration: runs anywhere, needs no device set up.

The gpu tier lives on CUDA where there is one and on the CPU otherwise; the pmem pool is a file on
tmpfs (``/dev/shm``: an *emulated* persistent memory that survives a process crash, not a reboot);
the nvme log is a file in a temporary directory on disk. Paths are set at run time.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from tierkv.config import Config, load_config

DEFAULT_TEMPLATE = """
[engine]
write_policy = "write_back"

[[tiers]]
name = "gpu"
kind = "gpu"
device = "auto"
capacity = "256MiB"
slot_size = "256KiB"
ttl = "5s"

[[tiers]]
name = "pmem"
kind = "pmem"
capacity = "512MiB"
format = true

[[tiers]]
name = "nvme"
kind = "nvme"
capacity = "2GiB"
region_size = "16MiB"
queue_depth = 32
direct = true
format = true
"""


def default_config(pmem_dir: Path, nvme_dir: Path) -> Config:
    """The default hierarchy with its pool under `pmem_dir` and its log under `nvme_dir`.

    The paths are set in the parsed document, never pasted into its text: a directory whose
    name holds a quote or a backslash (``--workdir '/x/a"b'``) would otherwise break the TOML
    or change what it says."""
    document = tomllib.loads(DEFAULT_TEMPLATE)
    pmem, nvme = document["tiers"][1], document["tiers"][2]
    pmem["path"] = str(pmem_dir / "tierkv.pool")
    nvme["path"] = str(nvme_dir / "tierkv.log")
    return load_config(document)


def shm_or(fallback: Path) -> Path:
    """``/dev/shm`` where it exists (a tmpfs), else `fallback`."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else fallback
