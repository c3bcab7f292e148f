"""Admission in front of a persistent tier: a frequency sketch whose strictness follows hit ratio.

Every lookup of a key (hit or miss) is counted in a count-min sketch (4 rows of small saturating
counters, halved every `sample` counts so that old popularity fades, as in TinyLFU). An object
demoted into the tier is admitted when its estimated frequency reaches `threshold`; at threshold
0 everything is admitted (`pass_all`). A fixed one-hit filter helps at small capacities and hurts
at large ones, so the threshold climbs, starting from 0: after each epoch of lookups it takes one
step (up first) and the next epoch's hit ratio judges it. A step that helped is kept and the climb
goes on; a step that hurt is undone, and the climber rests for a number of epochs that doubles
with each failed try (up to 64), so a workload where filtering never pays spends ever fewer
epochs trying it. Pure: no IO, no clock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from tierkv.config import Admission, SchedulerConfig
from tierkv.scheduler.placement import TierShape

_ROWS = 4


class FrequencySketch:
    def __init__(self, width: int, sample: int) -> None:
        self._mask = (1 << max(width - 1, 1).bit_length()) - 1
        self._table = [array("B", bytes(self._mask + 1)) for _ in range(_ROWS)]
        self._sample = sample
        self._added = 0

    @staticmethod
    def _hashes(key: bytes) -> tuple[int, int, int, int]:
        digest = hashlib.blake2b(key, digest_size=16).digest()
        return (int.from_bytes(digest[0:4], "little"), int.from_bytes(digest[4:8], "little"),
                int.from_bytes(digest[8:12], "little"), int.from_bytes(digest[12:16], "little"))

    def add(self, key: bytes) -> None:
        mask = self._mask
        for row, h in zip(self._table, self._hashes(key), strict=True):
            if row[h & mask] < 15:
                row[h & mask] += 1
        self._added += 1
        if self._added >= self._sample:
            self._halve()

    def estimate(self, key: bytes) -> int:
        mask = self._mask
        return min(row[h & mask] for row, h in zip(self._table, self._hashes(key), strict=True))

    def _halve(self) -> None:
        self._added //= 2
        for index, row in enumerate(self._table):
            self._table[index] = array("B", bytes(value >> 1 for value in row))


class AdaptiveAdmission:
    def __init__(self, capacity_objects: int, *, adaptive: bool = True, epoch: int | None = None,
                 max_threshold: int = 3) -> None:
        width = max(capacity_objects, 1024)
        self.sketch = FrequencySketch(width, sample=10 * width)
        self.adaptive = adaptive
        self.threshold = 0
        self.max_threshold = max_threshold
        self._epoch = epoch if epoch is not None else max(4 * capacity_objects, 2048)
        self._direction = 1
        self._step = 0  # the step the current epoch judges (0: none)
        self._rest = 0
        self._backoff = 1
        self._lookups = 0
        self._hits = 0
        self._previous: float | None = None
        self.admitted = 0
        self.rejected = 0

    def looked_up(self, key: bytes, hit: bool) -> None:
        """A lookup of `key` (`hit`: the cache served it); feeds the sketch and the climb."""
        if not self.adaptive:
            return
        self.sketch.add(key)
        self._lookups += 1
        self._hits += hit
        if self._lookups >= self._epoch:
            self._climb(self._hits / self._lookups)
            self._lookups = self._hits = 0

    def admits(self, key: bytes) -> bool:
        """Whether a demotion of `key` is let in now; counted only by `count`, once the plan
        it decides is made (an expiry's plan that finds no room is not)."""
        return self.threshold == 0 or self.sketch.estimate(key) >= self.threshold

    def count(self, admitted: bool) -> None:
        if admitted:
            self.admitted += 1
        else:
            self.rejected += 1

    def admit(self, key: bytes) -> bool:
        """`admits`, counted."""
        ok = self.admits(key)
        self.count(ok)
        return ok

    def _climb(self, ratio: float) -> None:
        if self._step and self._previous is not None and ratio < self._previous:
            self.threshold -= self._step  # it hurt: undo, and wait longer before the next try
            self._direction = -self._step
            self._step = 0
            self._rest = self._backoff
            self._backoff = min(2 * self._backoff, 64)
            self._previous = None
            return
        if self._step:
            self._backoff = 1  # it helped: keep climbing that way
        if self._rest:
            self._rest -= 1
            self._previous = ratio
            return
        target = min(max(self.threshold + self._direction, 0), self.max_threshold)
        if target == self.threshold:  # at a bound: the other way
            self._direction = -self._direction
            target = min(max(self.threshold + self._direction, 0), self.max_threshold)
        self._step = target - self.threshold
        self.threshold = target
        self._previous = ratio


def filters_for(tiers: Sequence[TierShape], capacities: Sequence[int] | None,
                config: SchedulerConfig) -> dict[int, AdaptiveAdmission]:
    """A filter in front of each persistent tier but the first (index -> filter)."""
    sizes = capacities if capacities is not None else [1 << 30] * len(tiers)
    # objects of 16 KiB as the unit of the sketch's width: it need not be exact
    return {index: AdaptiveAdmission(max(sizes[index] // 16384, 1),
                                     adaptive=config.admission is Admission.ADAPTIVE)
            for index, tier in enumerate(tiers) if tier.persistent and index > 0}
