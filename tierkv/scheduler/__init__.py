"""Policy: pure, synchronous decisions about where objects live. No IO here."""

from tierkv.scheduler.lru import LruPolicy
from tierkv.scheduler.placement import demotion_target, first_tier_for

__all__ = ["LruPolicy", "demotion_target", "first_tier_for"]
