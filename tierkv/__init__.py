"""tierkv: an asyncio engine that keeps immutable blobs across GPU, PMem and NVMe tiers."""

from tierkv.config import Config, load_config, load_config_text
from tierkv.engine import Engine, PinHandle, open
from tierkv.errors import (
    ConfigError,
    CorruptObjectError,
    DependencyCycleError,
    DeviceError,
    EngineClosedError,
    LimitExceededError,
    ObjectNotFound,
    TierFullError,
    TierKVError,
)
from tierkv.keys import BlockKey, Key, block_keys

__all__ = [
    "BlockKey",
    "Config",
    "ConfigError",
    "CorruptObjectError",
    "DependencyCycleError",
    "DeviceError",
    "Engine",
    "EngineClosedError",
    "Key",
    "LimitExceededError",
    "ObjectNotFound",
    "PinHandle",
    "TierFullError",
    "TierKVError",
    "block_keys",
    "load_config",
    "load_config_text",
    "open",
]
