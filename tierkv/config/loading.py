"""Loading and validating the TOML device configuration.

`load_config` takes a path to a TOML file, the text of one (`load_config_text`), an already parsed
mapping, or a `Config`, and returns a validated, immutable `Config` (`tierkv.config.schema`).
Every mistake raises `ConfigError` whose message starts with the key path (``tiers[1].capacity:
…``). Checks that need the machine (a CUDA device that must exist, a path that must be creatable
and writable, a capacity that must fit the memory, the block device or the file system's free
space) run here too, so a bad config fails before any device is touched.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from tierkv.config._redis import parse_redis_tier
from tierkv.config._table import REQUIRED, Table
from tierkv.config.machine import (
    MediaIdentity,
    check_device,
    check_memory,
    check_path,
    check_room,
    media_identity,
)
from tierkv.config.schema import (
    DEFAULT_FREE_HIGH,
    DEFAULT_FREE_LOW,
    MAX_WATERMARK,
    MIN_PMEM_POOL,
    NVME_SUPERBLOCK,
    SQ_POLL_MAX,
    SQ_POLL_MIN,
    Admission,
    Config,
    EngineConfig,
    EvictionPolicy,
    GpuTierConfig,
    HealthConfig,
    HostCopies,
    NvmeBackend,
    NvmeTierConfig,
    PmemTierConfig,
    RegionEviction,
    SchedulerConfig,
    TierConfig,
    TierKind,
    WritePolicy,
)
from tierkv.errors import ConfigError

#: the longest config file read: a config takes a few KiB
MAX_CONFIG_CHARS = 1 << 20


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | Config) -> Config:
    """Validate a config given as a TOML file path (its relative paths are beside the file), a
    parsed mapping (relative paths stay relative to the current directory) or a `Config`."""
    if isinstance(source, Config):
        return source
    if isinstance(source, Mapping):
        return _parse(source, None)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError("a config is a TOML file's path, a mapping or a tierkv.Config, "
                        f"not {type(source).__name__}")
    path = Path(source)
    try:
        # read up to the bound only: a pool or log named by mistake (or /dev/zero) was read
        # whole, a MemoryError or the OOM killer before any word about the config
        with path.open() as file:
            text = file.read(MAX_CONFIG_CHARS + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    if len(text) > MAX_CONFIG_CHARS:
        raise ConfigError(f"{path}: more than {MAX_CONFIG_CHARS} characters: not a config file")
    # the directory as named, not where a symlinked config file points: /etc/x/tierkv.toml's
    # `path = "pool"` is /etc/x/pool; absolute, so that a later chdir changes nothing either
    return _load_text(text, str(path), path.absolute().parent)


def load_config_text(text: str, *, origin: str = "<config>") -> Config:
    """Validate the text of a TOML config; its relative paths stay relative to the current
    directory (there is no file for them to be beside)."""
    return _load_text(text, origin, None)


def _load_text(text: str, origin: str, directory: Path | None) -> Config:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise ConfigError(f"{origin}: not valid TOML: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from None
    return _parse(document, directory)


def _parse(document: Mapping[str, Any], directory: Path | None) -> Config:
    """The config `document` says; `directory`: where its relative paths are (None: the
    current directory)."""
    root = Table(document, "")
    engine_table = root.table("engine")
    engine_defaults = EngineConfig()
    engine = EngineConfig(
        engine_table.choice("write_policy", WritePolicy, WritePolicy.WRITE_BACK),
        space_timeout=engine_table.duration("space_timeout", engine_defaults.space_timeout),
        group_commit=engine_table.boolean("group_commit", engine_defaults.group_commit),
        demotion_linger=engine_table.duration("demotion_linger",
                                              engine_defaults.demotion_linger, zero=True),
    )
    engine_table.finish()

    raw_tiers = root._raw("tiers", REQUIRED)
    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise ConfigError("tiers: expected at least one [[tiers]] table")
    tiers = tuple(_parse_tier(raw, f"tiers[{i}]", directory) for i, raw in enumerate(raw_tiers))
    _check_hierarchy(tiers)
    check_room(tiers)

    scheduler_table = root.table("scheduler")
    scheduler_defaults = SchedulerConfig()
    scheduler = SchedulerConfig(
        scheduler_table.choice("policy", EvictionPolicy, scheduler_defaults.policy),
        migration_bandwidth=scheduler_table.size_or_off("migration_bandwidth"),
        background_bandwidth=scheduler_table.size_or_off(
            "background_bandwidth", scheduler_defaults.background_bandwidth),
        migration_concurrency=scheduler_table.integer(
            "migration_concurrency", scheduler_defaults.migration_concurrency, low=1, high=1024),
        eviction_batch=scheduler_table.integer(
            "eviction_batch", scheduler_defaults.eviction_batch, low=1, high=4096),
        promote_on_hit=scheduler_table.boolean(
            "promote_on_hit", scheduler_defaults.promote_on_hit),
        alpha=scheduler_table.number("alpha", scheduler_defaults.alpha, low=0.0, high=1.0),
        beta=scheduler_table.number("beta", scheduler_defaults.beta, low=0.0, high=1e6),
        admission=scheduler_table.choice("admission", Admission, scheduler_defaults.admission),
        prefetch_depth=scheduler_table.integer(
            "prefetch_depth", scheduler_defaults.prefetch_depth, low=0, high=1024),
        exclusive=scheduler_table.boolean("exclusive", scheduler_defaults.exclusive),
    )
    scheduler_table.finish()

    h = root.table("health")
    defaults = HealthConfig()
    health = HealthConfig(
        failure_rate=h.number("failure_rate", defaults.failure_rate, low=0.0, high=1.0),
        window=h.duration("window", defaults.window),
        slow_operation=h.duration("slow_operation", defaults.slow_operation),
        cooldown=h.duration("cooldown", defaults.cooldown),
        close_after=h.integer("close_after", defaults.close_after, low=1, high=1000),
        entropy_alert_bits=h.number(
            "entropy_alert_bits", defaults.entropy_alert_bits, low=0.0, high=64.0
        ),
    )
    h.finish()
    root.finish()
    return Config(tiers=tiers, engine=engine, scheduler=scheduler, health=health)


def _parse_tier(raw: Any, path: str, directory: Path | None) -> TierConfig:
    t = Table(raw, path)
    name = t.string("name")
    kind_text = t.string("kind")
    try:
        kind = TierKind(kind_text)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in TierKind)
        raise t.error("kind", f"{kind_text!r} is not one of {allowed}") from None
    capacity = t.size("capacity")
    tier: TierConfig
    if kind is TierKind.GPU:
        slot_size = t.size("slot_size", 2 << 20)
        if capacity < slot_size:
            raise t.error("capacity", f"{capacity} bytes is less than one slot ({slot_size})")
        device = check_device(t, t.string("device", "auto"))
        check_memory(t, device, capacity)
        low, high = _watermarks(t)
        tier = GpuTierConfig(name, capacity, device, slot_size, t.duration("ttl", 5.0),
                             free_low=low, free_high=high,
                             host_copies=t.choice("host_copies", HostCopies, HostCopies.AUTO),
                             **_profile(t))
    elif kind is TierKind.REDIS:
        tier = parse_redis_tier(t, name, capacity, directory)
    elif kind is TierKind.PMEM:
        pool = check_path(t, "path", t.string("path"), TierKind.PMEM, directory)
        if capacity < MIN_PMEM_POOL:
            raise t.error("capacity", f"a pmem pool needs at least {MIN_PMEM_POOL} bytes")
        low, high = _watermarks(t)
        tier = PmemTierConfig(name, capacity, pool, t.boolean("format", False),
                              queue_depth=t.integer("queue_depth", 16, low=1, high=1024),
                              free_low=low, free_high=high, ttl=t.duration_or_off("ttl"),
                              **_profile(t))
    else:
        log = check_path(t, "path", t.string("path"), TierKind.NVME, directory)
        region_size = t.size("region_size", 64 << 20)
        if region_size % 4096 or region_size < (1 << 20):
            raise t.error("region_size", "must be a multiple of 4KiB and at least 1MiB")
        if capacity < NVME_SUPERBLOCK + region_size:
            raise t.error("capacity", "must hold the superblock and at least one region")
        tier = NvmeTierConfig(
            name,
            capacity,
            log,
            region_size=region_size,
            queue_depth=t.integer("queue_depth", 32, low=1, high=4096),
            direct=t.boolean("direct", True),
            backend=t.choice("backend", NvmeBackend, NvmeBackend.AUTO),
            eviction=t.choice("eviction", RegionEviction, RegionEviction.FIFO),
            reinsert_hits=t.integer("reinsert_hits", 2, low=0, high=1 << 30),
            format=t.boolean("format", False),
            sq_poll=t.duration_or_off("sq_poll"),
            ttl=t.duration_or_off("ttl"),
            **_profile(t),
        )
        if tier.sq_poll is not None and tier.backend is NvmeBackend.THREADS:
            raise t.error("sq_poll", 'needs the io_uring backend, not "threads"')
        if tier.sq_poll is not None and not SQ_POLL_MIN <= tier.sq_poll <= SQ_POLL_MAX:
            raise t.error("sq_poll", f"must be between {SQ_POLL_MIN * 1000:g}ms and "
                                     f"{SQ_POLL_MAX:g}s")
    t.finish()
    return tier


class _Profile(TypedDict):
    latency: float | None
    bandwidth: int | None


def _profile(t: Table) -> _Profile:
    """`latency` and `bandwidth` of a tier: given, or "probe" (the default) to measure them."""
    latency = None if t.raw("latency", "probe") == "probe" else t.duration("latency", 0.0)
    bandwidth = None if t.raw("bandwidth", "probe") == "probe" else t.size("bandwidth", 0)
    return {"latency": latency, "bandwidth": bandwidth}


def _watermarks(t: Table) -> tuple[float, float]:
    """`free_low` and `free_high` of a tier the engine evicts from; low ≤ high."""
    low = t.number("free_low", DEFAULT_FREE_LOW, low=0.0, high=MAX_WATERMARK)
    high = t.number("free_high", max(DEFAULT_FREE_HIGH, low), low=0.0, high=MAX_WATERMARK)
    if high < low:
        raise t.error("free_high", f"{high} is below free_low ({low})")
    return low, high


def _check_hierarchy(tiers: tuple[TierConfig, ...]) -> None:
    names: dict[str, int] = {}
    media_of: dict[MediaIdentity, tuple[int, Path]] = {}  # -> the tier using it, its path
    for index, tier in enumerate(tiers):
        if tier.kind is TierKind.REDIS and index == 0:
            raise ConfigError(f"tiers[{index}].kind: the redis tier is shared by engines; it "
                              "comes after at least one local tier")
        if tier.kind is TierKind.REDIS and index != len(tiers) - 1:
            raise ConfigError(f"tiers[{index}].kind: the redis tier is shared by engines and "
                              "must come last in the hierarchy")
        if tier.name in names:
            first = names[tier.name]
            raise ConfigError(f"tiers[{index}].name: {tier.name!r} is taken by tiers[{first}]")
        names[tier.name] = index
        if tier.kind is TierKind.GPU and index != 0:
            raise ConfigError(f"tiers[{index}].kind: a gpu tier must come first in the hierarchy")
        if isinstance(tier, PmemTierConfig | NvmeTierConfig):
            media = media_identity(tier.path)
            if media in media_of:
                first, path = media_of[media]
                # one media under two tiers: each would overwrite what the other wrote (or
                # format it away at open)
                raise ConfigError(f"tiers[{index}].path: {tier.path} is the file or device "
                                  f"also used by tiers[{first}].path ({path})")
            media_of[media] = (index, tier.path)
