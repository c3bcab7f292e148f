"""Builds the tier a `TierConfig` describes, and wipes a persistent tier's media; device-specific
modules are imported only here."""

from __future__ import annotations

from typing import TypeGuard

from tierkv.config import GpuTierConfig, NvmeTierConfig, PmemTierConfig, RedisTierConfig, TierConfig
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.tiers._wipe import Wiped, wipe_media
from tierkv.tiers.base import Tier

__all__ = ["Wiped", "make_tier", "persistent", "wipe"]


def make_tier(config: TierConfig) -> Tier:
    """An unopened tier for `config` (importing its mechanism lazily)."""
    if isinstance(config, GpuTierConfig):
        from tierkv.tiers.gpu import GpuTier

        return GpuTier(config)
    if isinstance(config, PmemTierConfig):
        from tierkv.tiers.pmem import PmemTier

        return PmemTier(config)
    if isinstance(config, NvmeTierConfig):
        from tierkv.tiers.nvme import NvmeTier

        return NvmeTier(config)
    if isinstance(config, RedisTierConfig):
        from tierkv.tiers.redis import RedisTier

        return RedisTier(config)
    raise TypeError(f"not a tier config: {config!r}")


def persistent(config: TierConfig) -> TypeGuard[PmemTierConfig | NvmeTierConfig]:
    """Whether the tier keeps what it holds on media (so `wipe` applies to it)."""
    return isinstance(config, PmemTierConfig | NvmeTierConfig)


def wipe(config: TierConfig) -> Wiped:
    """Make a persistent tier's media new (`tierkv format`), so that its next open finds it
    empty whatever its ``format`` says: a file truncated to size 0, a device's header area
    zeroed (`tierkv.tiers._wipe`). Raises `DeviceError` naming the path when the media cannot
    be wiped, or is held open (a pmem pool: PMDK's flock); `ValueError` for a volatile tier.
    The tier must not be open in this process."""
    if isinstance(config, PmemTierConfig):
        from tierkv.tiers.pmem import wipe as wipe_pool

        return wipe_pool(config)
    if isinstance(config, NvmeTierConfig):
        # the log is recognised by its superblock; a size-0 file or a zeroed superblock is new
        return wipe_media(config.path, SUPERBLOCK_SIZE)
    raise ValueError(f"tier {config.name!r} is a {config.kind.value} tier: "
                     "it keeps nothing on media")
