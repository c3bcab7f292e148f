"""A tier as the pure scheduler sees it, for policy tests: a size limit and a fill level."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Shape:
    limit: int
    persistent: bool = False
    reclaims_space: bool = False
    used: int = 0

    def can_ever_hold(self, nbytes: int) -> bool:
        return nbytes <= self.limit

    def footprint(self, nbytes: int) -> int:
        return nbytes

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit
