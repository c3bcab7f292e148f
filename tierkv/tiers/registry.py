"""Builds the tier a `TierConfig` describes, and wipes a persistent tier's media; device-specific
modules are imported only here."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TypeGuard

from tierkv.config import GpuTierConfig, NvmeTierConfig, PmemTierConfig, RedisTierConfig, TierConfig
from tierkv.errors import DeviceError
from tierkv.formats import pmem_layout
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.tiers._wipe import Wiped, claim
from tierkv.tiers.base import Tier

__all__ = ["Wiped", "make_tier", "persistent", "wipe", "wipe_all"]


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
    """Make a persistent tier's media new (`tierkv format --tier`): `wipe_all` of that one
    tier. `ValueError` for a volatile tier."""
    if not persistent(config):
        raise ValueError(f"tier {config.name!r} is a {config.kind.value} tier: "
                         "it keeps nothing on media")
    return wipe_all([config])[0]


def wipe_all(configs: Sequence[PmemTierConfig | NvmeTierConfig]) -> list[Wiped]:
    """Make the media of every tier in `configs` new (`tierkv format`), so that its next open
    finds it empty whatever its ``format`` says: a file truncated to size 0, a device's header
    area zeroed (`tierkv.tiers._wipe`). What each wipe did, in order.

    All or none, as far as can be told beforehand: every tier's media is first opened and
    locked, and stays locked until the last is wiped, so a tier held open (a pmem pool: PMDK's
    flock; an nvme log: its own), here or in another process, or a path that cannot be wiped
    refuses them all with nothing written: `DeviceError` naming that tier. A write failing
    part way (a failing device) raises a `DeviceError` naming that tier, those wiped before it
    and those not reached. A file whose truncation failed is as it was (a device whose header
    write failed half way may be neither: its next open refuses it as damaged); an open finds
    a wiped tier new beside the others as they were, as after `tierkv format --tier` of
    each."""
    with contextlib.ExitStack() as stack:
        claims = []
        for config in configs:
            try:
                taken = claim(config.path)
            except DeviceError as exc:
                others = [other.name for other in configs if other is not config]
                also = f"; nor was any other ({', '.join(others)})" if others else ""
                raise DeviceError(f"tier {config.name!r}: {exc}{also}") from exc
            stack.callback(taken.release)
            claims.append(taken)
        done: list[Wiped] = []
        for config, taken in zip(configs, claims, strict=True):
            try:
                done.append(taken.wipe(_header_area(config)))
            except DeviceError as exc:
                wiped = [f"{other.name} ({other.path})" for other in configs[:len(done)]]
                untouched = [other.name for other in configs[len(done) + 1:]]
                raise DeviceError(
                    f"tier {config.name!r}: {exc}; wiped before it: {', '.join(wiped) or 'none'}"
                    f"; not reached: {', '.join(untouched) or 'none'}. The next open finds the "
                    "wiped tiers empty and the others with what they hold; run it again for "
                    "the rest") from exc
        return done


def _header_area(config: PmemTierConfig | NvmeTierConfig) -> int:
    """The bytes at the start of the media its tier recognises it by (zeroed on a device)."""
    if isinstance(config, PmemTierConfig):
        return pmem_layout.HEADER_AREA
    return SUPERBLOCK_SIZE
