"""The interface of an eviction policy: the order in which one tier gives up its objects.

Small on purpose (in the spirit of vLLM's KV offload manager): the engine reports every copy that
enters (`insert`), is read (`touch`) or leaves (`remove`) a tier, and asks for victims
(`evict`) and for idle keys (`idle`, `idle_since`). A policy does no IO and keeps no reference to
the objects; time is passed in, so tests need no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class EvictionPolicy(Protocol):
    def __len__(self) -> int: ...

    def __contains__(self, key: bytes) -> bool: ...

    def insert(self, key: bytes, now: float) -> None:
        """A copy of `key` entered the tier (or was replaced) at `now`."""

    def touch(self, key: bytes, now: float) -> None:
        """`key` was read at `now`; no effect for a key the policy does not hold."""

    def remove(self, key: bytes) -> None:
        """The copy of `key` left the tier; no effect for an absent key."""

    def evict(self, count: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        """Up to `count` keys to give up first, best victim first, none of them `protected`.

        The keys stay in the policy until `remove`d (the engine removes each when its copy has
        left); the caller protects keys whose departure is already under way.
        """

    def idle(self, cutoff: float) -> list[bytes]:
        """Keys not read or inserted since `cutoff`, oldest first."""

    def idle_since(self, key: bytes, cutoff: float) -> bool:
        """Whether `key` is one of `idle(cutoff)`: held, and not read or inserted since
        `cutoff`."""
