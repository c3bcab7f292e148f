"""Where an object goes: its first tier on put, the first persistent tier, the tier below.

Until the cost-model scheduler lands, the hierarchy is walked top-down: an object enters the
fastest tier that can hold it at all, and an evicted object moves to the next tier down that can.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class SizedTier(Protocol):
    def can_ever_hold(self, nbytes: int) -> bool: ...

    def fits(self, nbytes: int) -> bool:
        """Whether the tier has room for `nbytes` now (a read of its counters, no IO)."""

    def footprint(self, nbytes: int) -> int:
        """Bytes an object of `nbytes` payload bytes occupies there."""


class TierShape(SizedTier, Protocol):
    """What policy knows of a tier: its geometry and two facts of its mechanism."""

    @property
    def persistent(self) -> bool: ...

    @property
    def reclaims_space(self) -> bool: ...


def first_tier_for(tiers: Sequence[SizedTier], nbytes: int, start: int = 0,
                   usable: Sequence[bool] | None = None) -> int | None:
    """Index of the first tier at or after `start` able to hold `nbytes`, or ``None``;
    `usable[i]` False: tier i is passed over (its circuit breaker is open)."""
    for index in range(start, len(tiers)):
        if (usable is None or usable[index]) and tiers[index].can_ever_hold(nbytes):
            return index
    return None


def demotion_target(tiers: Sequence[SizedTier], index: int, nbytes: int,
                    usable: Sequence[bool] | None = None) -> int | None:
    """Where an object evicted from tier `index` goes; ``None`` means it is dropped."""
    return first_tier_for(tiers, nbytes, index + 1, usable)


def first_persistent_for(tiers: Sequence[TierShape], nbytes: int, start: int = 0,
                         usable: Sequence[bool] | None = None) -> int | None:
    """The first persistent tier at or after `start` able to hold `nbytes`: where write-through
    puts and `flush` make an object durable; ``None`` if there is none."""
    for index in range(start, len(tiers)):
        if ((usable is None or usable[index]) and tiers[index].persistent
                and tiers[index].can_ever_hold(nbytes)):
            return index
    return None
