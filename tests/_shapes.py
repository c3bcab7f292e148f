"""What the pure scheduler sees, for policy tests: a tier (a size limit and a fill level) and an
index entry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Obj:
    """An index entry as the scheduler reads it (`Copies`)."""

    key: bytes
    nbytes: int = 10
    locations: Sequence[int] = field(default_factory=list)
    generation: int = 1


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
