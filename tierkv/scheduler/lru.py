"""Least-recently-used order of the objects in one tier, with their last access times.

An `EvictionPolicy` (`tierkv.scheduler.policy`): an ordered dict from key to last access time,
oldest first, so insert, touch and remove are O(1) and `evict` costs the victims it returns plus
the protected keys it skips, never a scan of the tier.
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

    def evict(self, count: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        victims: list[bytes] = []
        if count <= 0:
            return victims
        for key in self._last_access:
            if not protected(key):
                victims.append(key)
                if len(victims) == count:
                    break
        return victims

    def idle(self, cutoff: float) -> list[bytes]:
        stale: list[bytes] = []
        for key, last in self._last_access.items():
            if last >= cutoff:
                break
            stale.append(key)
        return stale

    def idle_since(self, key: bytes, cutoff: float) -> bool:
        last = self._last_access.get(key)
        return last is not None and last < cutoff
