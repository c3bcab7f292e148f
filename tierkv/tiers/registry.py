"""Builds the tier a `TierConfig` describes; device-specific modules are imported only here."""

from __future__ import annotations

from tierkv.config import GpuTierConfig, NvmeTierConfig, PmemTierConfig, TierConfig
from tierkv.tiers.base import Tier


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
    raise TypeError(f"not a tier config: {config!r}")
