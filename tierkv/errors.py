"""The one error hierarchy of tierkv; every public exception derives from `TierKVError`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.keys import Key


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


def _show(key: bytes) -> str:
    """A short, printable form of a key for messages: the repr of its first 16 bytes."""
    head = repr(bytes(key[:16]))
    return head if len(key) <= 16 else f"{head}…({len(key)} bytes)"


class DependencyCycleError(TierKVError, ValueError):
    """An edge ``parent -> child`` was refused: `parent` is `child`, or derives from it already.

    `parent` and `child` are the keys of the refused edge as the caller names them (a
    `BlockKey`, `bytes` or `str`; a model version as its ``"name@revision"`` form is not a key
    and stays in its canonical bytes), `raw_parent` and `raw_child` their canonical bytes
    (`tierkv.keys.encode_key`).
    """

    def __init__(self, parent: bytes, child: bytes) -> None:
        shown_parent, shown_child = _public(parent), _public(child)
        if parent == child:
            message = f"a key cannot derive from itself: {_show_key(shown_child)}"
        else:
            message = (f"edge {_show_key(shown_parent)} -> {_show_key(shown_child)} would close "
                       f"a cycle: {_show_key(shown_parent)} already derives from "
                       f"{_show_key(shown_child)}")
        super().__init__(message)
        self.parent: Key = shown_parent
        self.child: Key = shown_child
        self.raw_parent = parent
        self.raw_child = child


def _public(raw: bytes) -> Key:
    """The public key of a canonical byte form; the bytes themselves where they are none."""
    from tierkv.keys import decode_key  # keys imports this module

    try:
        return decode_key(raw)
    except TierKVError:
        return raw


def _show_key(key: Key) -> str:
    if isinstance(key, bytes):
        return _show(key)
    if isinstance(key, str):
        return repr(key[:32]) if len(key) <= 32 else f"{key[:32]!r}…({len(key)} characters)"
    return f"BlockKey({key.digest.hex()}, context_length={key.context_length})"


class LimitExceededError(TierKVError, ValueError):
    """A key, value or dependency is beyond a bound of the on-media format, so it could be
    written but never read back (`tierkv.formats.header`, `tierkv.formats.value`): refused by
    the public call before anything changes.

    `limit` names the bound (``"key bytes"``, ``"parents"``, ``"header body bytes"``, ...),
    `maximum` is its value and `actual` what the call asked for.
    """

    def __init__(self, limit: str, maximum: int, actual: int) -> None:
        super().__init__(f"{limit}: {actual} exceeds the format's limit of {maximum}")
        self.limit = limit
        self.maximum = maximum
        self.actual = actual


class TierUnavailableError(DeviceError):
    """A tier's circuit breaker is open: the call was not made (the caller skips the tier)."""
