"""Typed, key-path-aware access to one table of a TOML config: every mistake a `ConfigError`
whose message starts with the key's path (``tiers[1].capacity: …``)."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from tierkv._units import parse_duration, parse_size
from tierkv.errors import ConfigError

E = TypeVar("E", bound=enum.Enum)


#: the largest size a config may give: what a signed 64-bit byte count holds (8 EiB)
MAX_SIZE = (1 << 63) - 1


def shown(value: Any) -> str:
    """`value` for a message: an integer too long to print whole is shown by its length."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)


class Table:
    """Typed, path-aware access to one TOML table; `finish` refuses keys nobody asked for."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: expected a table, got {type(data).__name__}")
        self._data = data
        self._path = path
        self._seen: set[str] = set()

    def _key(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def _raw(self, key: str, default: Any) -> Any:
        self._seen.add(key)
        if key in self._data:
            return self._data[key]
        if default is REQUIRED:
            raise ConfigError(f"{self._key(key)}: missing required key")
        return default

    def raw(self, key: str, default: Any) -> Any:
        """The value as written (marked as read), for keys with a word among their values."""
        return self._raw(key, default)

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self._key(key)}: {message}")

    def string(self, key: str, default: Any = None) -> str:
        value = self._raw(key, REQUIRED if default is None else default)
        if not isinstance(value, str) or not value:
            raise self.error(key, f"expected a non-empty string, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def integer(self, key: str, default: int, *, low: int, high: int) -> int:
        value = self._raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        if not low <= value <= high:
            raise self.error(key, f"{shown(value)} is outside {low}..{high}")
        return value

    def number(self, key: str, default: float, *, low: float, high: float) -> float:
        value = self._raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a number, got {value!r}")
        # compared before any conversion: an integer beyond a float's range overflows float()
        if not (low <= value <= high and (isinstance(value, int) or math.isfinite(value))):
            raise self.error(key, f"{shown(value)} is outside {low}..{high}")
        return float(value)

    def size(self, key: str, default: int | None = None) -> int:
        value = self._raw(key, REQUIRED if default is None else default)
        if isinstance(value, int) and not isinstance(value, bool):
            size = value
        elif isinstance(value, str):
            try:
                size = parse_size(value)
            except ValueError as exc:
                raise self.error(key, str(exc)) from None
        else:
            raise self.error(key, f"expected a size such as \"512MiB\", got {value!r}")
        if size <= 0:
            raise self.error(key, "must be positive")
        if size > MAX_SIZE:
            raise self.error(key, f"{shown(size)} is more than 8EiB ({MAX_SIZE} bytes)")
        return size

    def duration(self, key: str, default: float, *, zero: bool = False) -> float:
        """Seconds; positive, or with `zero` also 0 (a wait that may be none at all)."""
        value = self._raw(key, default)
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                seconds = float(value)
            except OverflowError:  # an integer beyond a float's range
                raise self.error(key, f"{shown(value)} is too long") from None
        elif isinstance(value, str):
            try:
                seconds = parse_duration(value)
            except ValueError as exc:
                raise self.error(key, str(exc)) from None
        else:
            raise self.error(key, f"expected a duration such as \"800ms\", got {value!r}")
        if not math.isfinite(seconds):  # "999...9s": more digits than a float holds
            raise self.error(key, f"{shown(value)} is too long")
        if seconds < 0 or (seconds == 0 and not zero):
            raise self.error(key, "must not be negative" if zero else "must be positive")
        return seconds

    def size_or_off(self, key: str, default: int | None = None) -> int | None:
        """A size, or ``None`` for "off" (the default unless `default` is given)."""
        if self._raw(key, "off" if default is None else default) == "off":
            return None
        return self.size(key, default or 0)

    def duration_or_off(self, key: str) -> float | None:
        """A duration, or ``None`` for "off" (the default)."""
        if self._raw(key, "off") == "off":
            return None
        return self.duration(key, 0.0)

    def choice(self, key: str, enum_type: type[E], default: E) -> E:
        value = self._raw(key, default.value)
        try:
            return enum_type(value)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in enum_type)
            raise self.error(key, f"{value!r} is not one of {allowed}") from None

    def table(self, key: str) -> Table:
        return Table(self._raw(key, {}), self._key(key))

    def finish(self) -> None:
        unknown = sorted(set(self._data) - self._seen)
        if unknown:
            raise self.error(unknown[0], "unknown key")


REQUIRED = object()
