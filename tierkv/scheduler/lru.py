"""Least-recently-used order of the objects in one tier, with their last access times.

The interface is the small one a policy needs (`insert / touch / remove / victim / idle`); the
engine owns the objects and calls it on every access. Time is passed in, so tests need no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class LruPolicy:
    def __init__(self) -> None:
        self._last_access: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last_access)

    def __contains__(self, key: bytes) -> bool:
        return key in self._last_access

    def insert(self, key: bytes, now: float) -> None:
        self._last_access[key] = now
        self._last_access.move_to_end(key)

    def touch(self, key: bytes, now: float) -> None:
        if key in self._last_access:
            self._last_access[key] = now
            self._last_access.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._last_access.pop(key, None)

    def victim(self, protected: Callable[[bytes], bool]) -> bytes | None:
        """The least recently used key that is not protected, or ``None``.

        Cost is the number of protected keys skipped, not the number of keys held.
        """
        for key in self._last_access:
            if not protected(key):
                return key
        return None

    def idle(self, cutoff: float) -> list[bytes]:
        """Keys not accessed since `cutoff`, least recently used first."""
        stale: list[bytes] = []
        for key, last in self._last_access.items():
            if last >= cutoff:
                break
            stale.append(key)
        return stale
