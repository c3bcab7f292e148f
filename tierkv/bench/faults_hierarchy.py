"""The hierarchy an epoch of the fault soak runs on (`soak_hierarchy`).

The config's tiers, resized so that the soak's key space spills through all of them
(as the trace replay resizes them): a gpu tier of 16 KiB slots holding an eighth of the working
set; a pmem pool of 8 MiB kept 85-90 % free (its watermarks) where an nvme log follows, so
that demotion keeps the log busy; an nvme log of 1 MiB regions with room for everything an
epoch writes (a region reclaim drops live entries: a loss that is the cache's, not a fault's);
a redis tier as configured, under a key prefix of the epoch's own. Persistent tiers get fresh
media in scratch directories beside their configured paths, deleted at the end. `[health]` is
the config's, its cool-down capped at `COOLDOWN_CAP` so that breakers cycle within minutes.

Apart from the driver (`tierkv.bench.faults`) because it is configuration, not workload: it
makes the config an epoch opens and removes the scratch media afterwards.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from tierkv.config import (
    MIN_PMEM_POOL,
    NVME_SUPERBLOCK,
    Config,
    GpuTierConfig,
    NvmeTierConfig,
    PmemTierConfig,
    RedisTierConfig,
    TierConfig,
)
from tierkv.errors import ConfigError

SLOT = 16 << 10
REGION = 1 << 20
#: the longest cool-down a soak runs with (seconds)
COOLDOWN_CAP = 5.0


@contextlib.contextmanager
def soak_hierarchy(config: Config, working_set: int, log_bytes: int, prefix: str
                   ) -> Iterator[Config]:
    """`config` resized for a soak (see the module), its persistent tiers on fresh media in
    scratch directories deleted on exit, its redis tier's keys under `prefix`."""
    scratch: list[Path] = []
    try:
        tiers: list[TierConfig] = []
        for index, tier in enumerate(config.tiers):
            below = any(isinstance(t, NvmeTierConfig) for t in config.tiers[index + 1:])
            if isinstance(tier, GpuTierConfig):
                slot = min(tier.slot_size, SLOT)
                capacity = max(slot, working_set // 8 // slot * slot)
                tiers.append(replace(tier, capacity=capacity, slot_size=slot))
            elif isinstance(tier, RedisTierConfig):
                tiers.append(replace(tier, key_prefix=f"{tier.key_prefix}{prefix}:"))
            elif isinstance(tier, PmemTierConfig):
                scratch.append(directory := _scratch_dir(tier))
                if below:
                    pool = replace(tier, capacity=MIN_PMEM_POOL, free_low=0.85, free_high=0.9)
                else:  # the last local tier: room for all, nothing evicted
                    pool = replace(tier, capacity=max(MIN_PMEM_POOL, 4 * working_set))
                tiers.append(replace(pool, path=directory / tier.path.name, format=True))
            else:
                assert isinstance(tier, NvmeTierConfig)
                scratch.append(directory := _scratch_dir(tier))
                regions = max(16, math.ceil(log_bytes / REGION))
                tiers.append(replace(tier, path=directory / tier.path.name, format=True,
                                     capacity=NVME_SUPERBLOCK + regions * REGION,
                                     region_size=REGION))
        health = replace(config.health, cooldown=min(config.health.cooldown, COOLDOWN_CAP))
        yield replace(config, tiers=tuple(tiers), health=health)
    finally:
        for directory in scratch:
            shutil.rmtree(directory, ignore_errors=True)


def _scratch_dir(tier: PmemTierConfig | NvmeTierConfig) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix="tierkv-soak-", dir=tier.path.parent))
    except OSError as exc:
        raise ConfigError(f"{tier.name}.path: cannot make a scratch directory for the soak in "
                          f"{tier.path.parent}: {exc.strerror or exc}") from None
