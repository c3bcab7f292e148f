"""Policy: pure, synchronous decisions about where objects live, returned as plans. No IO here."""

from tierkv.scheduler.lru import LruPolicy
from tierkv.scheduler.placement import demotion_target, first_persistent_for, first_tier_for
from tierkv.scheduler.plans import (
    Demote,
    Departure,
    Drop,
    Evict,
    Plan,
    Promote,
    Share,
    departs_from,
)
from tierkv.scheduler.policy import EvictionPolicy
from tierkv.scheduler.scheduler import Copies, Lookup, Scheduler
from tierkv.scheduler.watermarks import Watermarks

__all__ = [
    "Copies",
    "Demote",
    "Departure",
    "Drop",
    "Evict",
    "EvictionPolicy",
    "Lookup",
    "LruPolicy",
    "Plan",
    "Promote",
    "Scheduler",
    "Share",
    "Watermarks",
    "demotion_target",
    "departs_from",
    "first_persistent_for",
    "first_tier_for",
]
