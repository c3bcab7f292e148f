"""The TOML device configuration: schema (`schema`), loading and validation (`loading`), and the
embedded default (`default`)."""

from tierkv.config.loading import load_config, load_config_text
from tierkv.config.schema import (
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
    NvmeBackend,
    NvmeTierConfig,
    PmemTierConfig,
    RedisTierConfig,
    RegionEviction,
    SchedulerConfig,
    TierConfig,
    TierKind,
    WritePolicy,
)

__all__ = [
    "MIN_PMEM_POOL",
    "NVME_SUPERBLOCK",
    "SQ_POLL_MAX",
    "SQ_POLL_MIN",
    "Admission",
    "Config",
    "EngineConfig",
    "EvictionPolicy",
    "GpuTierConfig",
    "HealthConfig",
    "NvmeBackend",
    "NvmeTierConfig",
    "PmemTierConfig",
    "RedisTierConfig",
    "RegionEviction",
    "SchedulerConfig",
    "TierConfig",
    "TierKind",
    "WritePolicy",
    "load_config",
    "load_config_text",
]
