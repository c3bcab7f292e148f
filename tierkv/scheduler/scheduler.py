"""The scheduler: per-tier eviction policies and the decisions made from them, as plans.

Pure and synchronous: no IO, time passed in. The engine reports what enters, is read in and
leaves each tier (`admitted`, `accessed`, `removed`) and asks what to do: which tier a put goes
to (`write_tier`), where write-through and `flush` make an object durable (`durable_tier`), where
a copy goes when it must leave a tier (`departures`, `expired`), and whether a hit in a lower tier
earns a copy upward (`on_hit`). It reads the engine's index only through `Lookup`, which answers
for one key at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from tierkv.config import SchedulerConfig
from tierkv.scheduler.lru import LruPolicy
from tierkv.scheduler.placement import (
    TierShape,
    demotion_target,
    first_persistent_for,
    first_tier_for,
)
from tierkv.scheduler.plans import Demote, Departure, Drop, Evict, Promote
from tierkv.scheduler.policy import EvictionPolicy


class Copies(Protocol):
    """What the scheduler reads of one indexed object."""

    @property
    def key(self) -> bytes: ...

    @property
    def generation(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def locations(self) -> Sequence[int]:
        """Tiers holding a copy, fastest first."""


#: the index seen by the scheduler: a key's object, or ``None``
Lookup = Callable[[bytes], Copies | None]


class Scheduler:
    def __init__(self, tiers: Sequence[TierShape], config: SchedulerConfig) -> None:
        self._tiers = tuple(tiers)
        self._config = config
        self.policies: tuple[EvictionPolicy, ...] = tuple(LruPolicy() for _ in self._tiers)

    # -- events ------------------------------------------------------------------------------
    def admitted(self, tier: int, key: bytes, now: float) -> None:
        self.policies[tier].insert(key, now)

    def accessed(self, tier: int, key: bytes, now: float) -> None:
        self.policies[tier].touch(key, now)

    def removed(self, tier: int, key: bytes) -> None:
        self.policies[tier].remove(key)

    # -- placement ---------------------------------------------------------------------------
    def write_tier(self, nbytes: int) -> int | None:
        """The tier a put goes to (the fastest that can hold it at all)."""
        return first_tier_for(self._tiers, nbytes)

    def next_tier(self, nbytes: int, after: int) -> int | None:
        """Where a write that the tier `after` could not take goes next."""
        return first_tier_for(self._tiers, nbytes, after + 1)

    def durable_tier(self, nbytes: int, start: int = 0) -> int | None:
        """Where write-through and `flush` make an object durable."""
        return first_persistent_for(self._tiers, nbytes, start)

    # -- moves -------------------------------------------------------------------------------
    def departures(self, tier: int, count: int, protected: Callable[[bytes], bool],
                   lookup: Lookup) -> list[Departure]:
        """Up to `count` plans that free space in `tier`, best victims first."""
        plans: list[Departure] = []
        for key in self.policies[tier].evict(count, protected):
            copies = lookup(key)
            if copies is not None and tier in copies.locations:
                plans.append(self._depart(tier, copies))
        return plans

    def expired(self, tier: int, cutoff: float, protected: Callable[[bytes], bool],
                lookup: Lookup) -> list[Departure]:
        """Plans moving what was idle in `tier` since before `cutoff` (its TTL) out of it."""
        plans: list[Departure] = []
        for key in self.policies[tier].idle(cutoff):
            copies = lookup(key)
            if not protected(key) and copies is not None and tier in copies.locations:
                plans.append(self._depart(tier, copies))
        return plans

    def _depart(self, tier: int, copies: Copies) -> Departure:
        key, generation, nbytes = copies.key, copies.generation, copies.nbytes
        if any(location > tier for location in copies.locations):
            return Evict(key, generation, nbytes, tier)
        target = demotion_target(self._tiers, tier, nbytes)
        if target is None:
            return Drop(key, generation, nbytes, tier)
        return Demote(key, generation, nbytes, tier, target)

    def on_hit(self, copies: Copies, served_from: int) -> Promote | None:
        """Whether a hit served from `served_from` earns a copy in the first tier (LRU: every
        hit below the first tier does, where the first tier can hold the object)."""
        top = 0
        if (not self._config.promote_on_hit or served_from <= top or top in copies.locations
                or self._tiers[top].reclaims_space
                or not self._tiers[top].can_ever_hold(copies.nbytes)):
            return None
        return Promote(copies.key, copies.generation, copies.nbytes, served_from, top)
