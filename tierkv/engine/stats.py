"""Engine counters, reported by `Engine.stats()`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineCounters:
    puts: int = 0
    gets: int = 0
    misses: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    evictions: Counter[str] = field(default_factory=Counter)
    demotions: Counter[str] = field(default_factory=Counter)
    drops: int = 0
    expired: int = 0
    corrupt_reads: int = 0
    device_errors: int = 0
    invalidations: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "puts": self.puts,
            "gets": self.gets,
            "misses": self.misses,
            "hits": dict(self.hits),
            "evictions": dict(self.evictions),
            "demotions": dict(self.demotions),
            "drops": self.drops,
            "expired": self.expired,
            "corrupt_reads": self.corrupt_reads,
            "device_errors": self.device_errors,
            "invalidations": self.invalidations,
        }
