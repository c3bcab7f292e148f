"""A TOML config of the three device tiers, tiny, on files under one directory: the fault
soak's hierarchy, and the one CLI tests run whole commands on."""

from __future__ import annotations

from pathlib import Path


def three_tier_toml(directory: Path, write_policy: str = "write_back") -> str:
    """gpu 1 MiB of 16 KiB slots (on the CPU), pmem 8 MiB in `directory`/pool, nvme 64 MiB of
    1 MiB regions in `directory`/log (both folders made here); short health timings."""
    (directory / "pool").mkdir()
    (directory / "log").mkdir()
    return f"""
[engine]
write_policy = "{write_policy}"

[health]
slow_operation = "100ms"
cooldown = "1s"

[[tiers]]
name = "gpu"
kind = "gpu"
device = "cpu"
capacity = "1MiB"
slot_size = "16KiB"

[[tiers]]
name = "pmem"
kind = "pmem"
path = "{directory / "pool" / "tierkv.pool"}"
capacity = "8MiB"

[[tiers]]
name = "nvme"
kind = "nvme"
path = "{directory / "log" / "tierkv.log"}"
capacity = "64MiB"
region_size = "1MiB"
"""
