"""The hierarchy a trace replay runs on at one capacity point: the user's config, resized.

A capacity point is a total of `total_bytes` split over the tiers the config has, 20 % gpu / 30 %
pmem / 50 % nvme (the shares renormalised over the kinds present, a kind's share split evenly
over its tiers). Everything else of each tier is kept (kind, device, queue depths, region size...)
but for what the replay needs:

- a gpu tier's `slot_size` becomes the block size: the split is counted in blocks, and a larger
  slot would hold one block all the same and leave the rest of itself unused;
- a persistent tier gets a fresh path in a temporary directory beside its configured one (the
  pmem pool stays on the file system it was configured on, ``/dev/shm`` by default), with
  ``format = true``; the directory is deleted when the point is done;
- each tier's capacity is rounded to what its mechanism can use (whole slots, whole nvme regions
  behind the superblock) and raised to its minimum (one slot, `MIN_PMEM_POOL`, one region) where
  the share is smaller: `TierSizing` records both the share and what was configured, so a report
  can say where a point holds more than its total.

The scheduler gets the replayed policy (`ReplayPolicy`) and no pacing of background moves
(`background_bandwidth = None`): the replay runs in accelerated virtual time, and a pace meant
for wall-clock time would leave the moves behind the requests.
"""

from __future__ import annotations

import contextlib
import enum
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from tierkv.config import (
    MIN_PMEM_POOL,
    NVME_SUPERBLOCK,
    Admission,
    Config,
    EvictionPolicy,
    GpuTierConfig,
    NvmeTierConfig,
    PmemTierConfig,
    RedisTierConfig,
    TierConfig,
    TierKind,
)
from tierkv.errors import ConfigError

#: each kind's share of a capacity point's bytes, before renormalising over the kinds present
SHARES: dict[TierKind, float] = {TierKind.GPU: 0.2, TierKind.PMEM: 0.3, TierKind.NVME: 0.5}


class ReplayPolicy(enum.Enum):
    """What the engine runs with during a replay (`--policy`)."""

    #: plain LRU in each tier, every demotion admitted: the engine as the offline LRU baseline
    LRU = "lru"
    #: tierkv's own: LRU++ with the config's other scheduler settings (admission, alpha, beta)
    TIERKV = "tierkv"

    def scheduler(self, configured: Admission) -> tuple[EvictionPolicy, Admission]:
        if self is ReplayPolicy.LRU:
            return EvictionPolicy.LRU, Admission.PASS_ALL
        return EvictionPolicy.LRUPP, configured


@dataclass(frozen=True, slots=True)
class TierSizing:
    """One tier at one capacity point: the bytes its share gave it and the bytes configured."""

    name: str
    kind: TierKind
    #: the renormalised share of the point's total
    share: float
    share_bytes: int
    #: the capacity configured: the share rounded to the mechanism, or its minimum
    capacity: int
    #: the share was below the tier's minimum (one slot, `MIN_PMEM_POOL`, one region), so
    #: `capacity` is that minimum
    raised_to_minimum: bool


def tier_shares(config: Config) -> list[float]:
    """Each tier's fraction of a capacity point, in the config's order (they sum to 1)."""
    counts = {kind: sum(tier.kind is kind for tier in config.tiers) for kind in TierKind}
    present = sum(share for kind, share in SHARES.items() if counts[kind])
    return [SHARES[tier.kind] / present / counts[tier.kind] for tier in config.tiers]


def _resized_gpu(tier: GpuTierConfig, share_bytes: int, block_size: int
                 ) -> tuple[GpuTierConfig, int, bool]:
    """`tier` holding `share_bytes` in whole block-sized slots; (config, capacity, raised)."""
    capacity = max(1, round(share_bytes / block_size)) * block_size
    resized = replace(tier, capacity=capacity, slot_size=block_size)
    return resized, capacity, share_bytes < block_size


def _resized_persistent(tier: PmemTierConfig | NvmeTierConfig, share_bytes: int, scratch: Path
                        ) -> tuple[PmemTierConfig | NvmeTierConfig, int, bool]:
    """`tier` holding `share_bytes`, its media new in `scratch`; (config, capacity, raised)."""
    path = scratch / tier.path.name
    if isinstance(tier, PmemTierConfig):
        capacity = max(share_bytes, MIN_PMEM_POOL)
        resized = replace(tier, capacity=capacity, path=path, format=True)
        return resized, capacity, share_bytes < MIN_PMEM_POOL
    # The log's capacity is its region area behind the superblock, in whole regions. Regions
    # are made smaller (never below 1 MiB) where the share holds fewer than `MIN_REGIONS`, so
    # that rounding to whole regions and the region reclaim costs stay a few percent of the
    # share instead of a fifth of it at the small capacity points.
    region = tier.region_size
    while region > MIN_REGION and share_bytes < MIN_REGIONS * region:
        region //= 2
    area = max(1, round(share_bytes / region)) * region
    log = replace(tier, capacity=NVME_SUPERBLOCK + area, path=path, format=True,
                  region_size=region)
    return log, area, share_bytes < region


#: the replay's logs get regions of at least 1 MiB, and at least this many of them if possible
MIN_REGION = 1 << 20
MIN_REGIONS = 64


@contextlib.contextmanager
def capacity_point(config: Config, total_bytes: int, block_size: int, policy: ReplayPolicy,
                   ) -> Iterator[tuple[Config, list[TierSizing]]]:
    """`config` resized to `total_bytes` for `policy` (see the module docstring), with fresh
    scratch directories for its persistent tiers that are deleted on exit.

    Raises `ConfigError` when a configured tier's directory cannot hold a scratch directory.
    """
    scratch_dirs: list[Path] = []
    try:
        tiers: list[TierConfig] = []
        sizings: list[TierSizing] = []
        for tier, share in zip(config.tiers, tier_shares(config), strict=True):
            share_bytes = int(total_bytes * share)
            resized: TierConfig
            if isinstance(tier, GpuTierConfig):
                resized, capacity, raised = _resized_gpu(tier, share_bytes, block_size)
            elif isinstance(tier, RedisTierConfig):
                raise ConfigError(f"--trace: tier {tier.name!r} is a shared redis tier; replay "
                                  "a trace on local tiers only")
            else:
                scratch_dirs.append(scratch := _scratch_dir(tier))
                resized, capacity, raised = _resized_persistent(tier, share_bytes, scratch)
            tiers.append(resized)
            sizings.append(TierSizing(tier.name, tier.kind, share, share_bytes, capacity, raised))
        eviction, admission = policy.scheduler(config.scheduler.admission)
        scheduler = replace(config.scheduler, policy=eviction, admission=admission,
                            background_bandwidth=None)
        yield replace(config, tiers=tuple(tiers), scheduler=scheduler), sizings
    finally:
        for directory in scratch_dirs:
            shutil.rmtree(directory, ignore_errors=True)


def _scratch_dir(tier: PmemTierConfig | NvmeTierConfig) -> Path:
    parent = tier.path.parent
    try:
        return Path(tempfile.mkdtemp(prefix="tierkv-trace-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"{tier.name}.path: cannot make a scratch directory for the trace "
                          f"replay in {parent}: {exc.strerror or exc}") from None
