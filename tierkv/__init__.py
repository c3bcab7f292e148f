"""tierkv: an asyncio engine that keeps immutable blobs across GPU, PMem and NVMe tiers.

The names below are imported when first used (PEP 562), not with the package: the engine takes
torch with it, a couple of seconds, and the `tierkv` command must be able to answer a signal
before that (`tierkv.cli`). ``from tierkv import open`` and ``tierkv.open`` work as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: each public name and the module it comes from
_HOMES = {
    "BlockKey": "tierkv.keys",
    "Config": "tierkv.config",
    "ConfigError": "tierkv.errors",
    "CorruptObjectError": "tierkv.errors",
    "DependencyCycleError": "tierkv.errors",
    "DeviceError": "tierkv.errors",
    "Engine": "tierkv.engine",
    "EngineClosedError": "tierkv.errors",
    "Key": "tierkv.keys",
    "LimitExceededError": "tierkv.errors",
    "ObjectNotFound": "tierkv.errors",
    "PinHandle": "tierkv.engine",
    "TierFullError": "tierkv.errors",
    "TierKVError": "tierkv.errors",
    "block_keys": "tierkv.keys",
    "load_config": "tierkv.config",
    "load_config_text": "tierkv.config",
    "open": "tierkv.engine",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later uses find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
