"""Plans: what the scheduler decides should move, as data the engine's executor runs.

Each plan names one object by key and by the generation the decision was made for; the executor
checks that generation again when it runs the plan, so a plan made for a value that was
overwritten, deleted or invalidated meanwhile is discarded instead of moving the new value. A
departure made because its object idled (a TTL's, `Scheduler.expired`) carries the cutoff it was
idle since: the executor asks the scheduler again when the plan runs (`Scheduler.still_idle`),
which may be long after (the plans are paced by `background_bandwidth`), and a plan whose object
was read meanwhile is discarded rather than demoting a hot object.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Promote:
    """Copy the object from `source` up into `target`; `exclusive`: then delete the source copy
    (the object moves, and counts against one tier's capacity only)."""

    key: bytes
    generation: int
    nbytes: int
    source: int
    target: int
    exclusive: bool = False


@dataclass(frozen=True, slots=True)
class Demote:
    """Move the object from `source` down into `target` (or the first tier below it that takes
    it); the source copy goes once the target holds it, durably if the source was durable."""

    key: bytes
    generation: int
    nbytes: int
    source: int
    target: int
    #: a TTL's plan: the cutoff its object was idle since, and must still be when the plan runs
    idle_since: float | None = None


@dataclass(frozen=True, slots=True)
class Evict:
    """Delete the copy in `tier`: a lower tier holds another copy already."""

    key: bytes
    generation: int
    nbytes: int
    tier: int
    #: a TTL's plan: the cutoff its object was idle since, and must still be when the plan runs
    idle_since: float | None = None


@dataclass(frozen=True, slots=True)
class Drop:
    """Delete the copy in `tier`, the last one that can hold it: the object leaves the cache."""

    key: bytes
    generation: int
    nbytes: int
    tier: int
    #: a TTL's plan: the cutoff its object was idle since, and must still be when the plan runs
    idle_since: float | None = None


@dataclass(frozen=True, slots=True)
class Share:
    """Copy the object from `source` into the shared tier `target`, keeping the source copy:
    other engines find it there."""

    key: bytes
    generation: int
    nbytes: int
    source: int
    target: int


Plan = Promote | Demote | Evict | Drop | Share
#: plans that free space in the tier they name (the evictor's and expiry's plans)
Departure = Demote | Evict | Drop


def departs_from(plan: Departure) -> int:
    """The tier a departure frees space in."""
    return plan.source if isinstance(plan, Demote) else plan.tier
