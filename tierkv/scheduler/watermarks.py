"""Free-space watermarks of a tier: when its evictor starts, and how much it frees."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Watermarks:
    """Bytes of free space: below `low` the evictor starts; it stops once `high` are free."""

    low: int
    high: int

    @classmethod
    def of(cls, capacity: int, free_low: float, free_high: float) -> Watermarks:
        """From fractions of `capacity` (at least one byte each where the fraction is not 0)."""
        return cls(math.ceil(capacity * free_low), math.ceil(capacity * free_high))

    def short(self, free: int) -> bool:
        """Whether the evictor must start."""
        return free < self.low

    def to_free(self, free: int, leaving: int, wanted: int) -> int:
        """Bytes the evictor should still set moving: up to the high watermark, or to what
        waiting puts want if that is more, less what departures under way will free."""
        return max(max(self.high, wanted) - free - leaving, 0)
