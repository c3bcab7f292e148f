"""Shared pieces of the benchmarks: result rows, percentiles, progress reporting."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

#: called as progress(phase, done, total) while a benchmark runs
Progress = Callable[[str, int, int], None]


def no_progress(phase: str, done: int, total: int) -> None:
    """A `Progress` that shows nothing."""


@dataclass(frozen=True, slots=True)
class Row:
    """One figure beside its baseline from the same run.

    `ratio` is measured / baseline (for latencies, where lower is better, the caller states the
    direction in `case`); `target` is the least ratio the project aims for, if any. `at_most` and
    `at_least` are absolute goals for figures that have no baseline (a p50 latency bound).
    """

    case: str
    unit: str
    measured: float
    baseline: float | None = None
    baseline_name: str = ""
    target: float | None = None
    at_most: float | None = None
    at_least: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.measured / self.baseline

    @property
    def meets_target(self) -> bool | None:
        checks: list[bool] = []
        if self.target is not None and self.ratio is not None:
            checks.append(self.ratio >= self.target)
        if self.at_most is not None:
            checks.append(self.measured <= self.at_most)
        if self.at_least is not None:
            checks.append(self.measured >= self.at_least)
        return all(checks) if checks else None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ratio"] = self.ratio
        data["meets_target"] = self.meets_target
        return data


def percentile(sorted_samples: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile (nearest rank) of already sorted samples."""
    if not sorted_samples:
        return math.nan
    rank = min(len(sorted_samples) - 1, max(0, math.ceil(fraction * len(sorted_samples)) - 1))
    return sorted_samples[rank]


def memcpy_seconds(size: int, count: int, *, scatter: bool) -> float:
    """`count` copies of `size` bytes between one buffer and `count` distinct slots.

    `scatter`: from one source into distinct destinations (what a put does); otherwise from
    distinct sources into one destination (what a get does). Both sides are touched first, so
    no page fault is timed, and the working set is as large as the tier's.
    """
    single = np.frombuffer(bytearray(os.urandom(size)), dtype=np.uint8)
    slots = np.ones(size * count, dtype=np.uint8)
    start = time.perf_counter()
    for i in range(count):
        slot = slots[i * size : (i + 1) * size]
        if scatter:
            np.copyto(slot, single)
        else:
            np.copyto(single, slot)
    return time.perf_counter() - start


async def drive(keys: Iterable[bytes], depth: int,
                 request: Callable[[bytes], Awaitable[object]]) -> float:
    """Seconds to run `request` for every key with `depth` requests in flight."""
    pending = iter(keys)

    async def lane() -> None:
        for key in pending:
            await request(key)

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(depth)))
    return time.perf_counter() - start
