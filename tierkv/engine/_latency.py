"""Latency histograms of the engine's gets and puts: fixed buckets, recorded on the hot path.

Bucket bounds are one 1-2-5 series from 1 µs to 10 s (22 upper bounds, each inclusive, and an
open last bucket above 10 s), the same for every histogram, so histograms of different tiers and
engines add up bucket by bucket. Recording one duration is a bisect into that tuple, an increment
and an addition: O(log 22), nothing allocated. Read on the loop (`Engine.metrics`), written on
the loop; not thread-safe.
"""

from __future__ import annotations

from bisect import bisect_left

from tierkv.metrics.snapshot import Histogram

#: upper bounds of the buckets, seconds (1 µs, 2 µs, 5 µs, 10 µs, ... 5 s, 10 s)
BOUNDS: tuple[float, ...] = (
    *(float(f"{mantissa}e{exponent}") for exponent in range(-6, 1) for mantissa in (1, 2, 5)),
    10.0,
)


class Recorder:
    """One histogram being recorded: counts per bucket (`BOUNDS`, then the open bucket)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BOUNDS, seconds)] += 1
        self.total += seconds

    def snapshot(self) -> Histogram:
        return Histogram(BOUNDS, tuple(self.counts), self.total)


class Latencies:
    """The engine's histograms, of calls that returned (not those that raised): `get` calls by
    the tier that served them, and misses; puts by the tier their object went into first;
    `get_many` calls as a whole (one duration per call: its keys are read together, so a
    per-key figure would say nothing). A duration runs from the call's start to its value
    decoded: the key encoded, the lookup, the read, the decode."""

    __slots__ = ("get_many", "hits", "misses", "puts")

    def __init__(self, tiers: int) -> None:
        self.hits = tuple(Recorder() for _ in range(tiers))
        self.misses = Recorder()
        self.puts = tuple(Recorder() for _ in range(tiers))
        self.get_many = Recorder()

    def got(self, tier: int | None, seconds: float) -> None:
        """A get served by `tier` (None: a miss) took `seconds` (`Recorder.observe`, inlined:
        this runs in every get)."""
        recorder = self.misses if tier is None else self.hits[tier]
        recorder.counts[bisect_left(BOUNDS, seconds)] += 1
        recorder.total += seconds
