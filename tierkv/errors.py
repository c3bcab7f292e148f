"""The one error hierarchy of tierkv; every public exception derives from `TierKVError`."""

from __future__ import annotations


class TierKVError(Exception):
    """Base class of every error tierkv raises on purpose."""


class ConfigError(TierKVError, ValueError):
    """A configuration is wrong; the message starts with the key path (``tiers[1].capacity: …``)."""


class CorruptObjectError(TierKVError):
    """Bytes read from media (or handed to a decoder) are not a valid tierkv object."""


class TierFullError(TierKVError):
    """A tier cannot hold an object: larger than the tier, or no room left that can be freed."""


class DeviceError(TierKVError):
    """A device or its media failed (EIO, ENOSPC, a pool in use, another format on the path).

    `errno` is the operating system's error number when the failure came with one.
    """

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class ObjectNotFound(TierKVError, KeyError):
    """The key is not stored anywhere (raised by `pin`; `get` returns ``None`` instead)."""


class EngineClosedError(TierKVError, RuntimeError):
    """The engine (or a tier) was used after `close()`."""
