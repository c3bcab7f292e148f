"""Miss-storm detection: the Shannon entropy of missed keys' prefixes over a sliding window.

A healthy cache misses all over its key space; a storm (a cold tenant, a flushed tier, a client
replaying one model's prompts) misses one part of it. The caller reports each miss with a prefix
of the key that names the part it belongs to; the engine passes the leading, namespace-like bytes
of the canonical key (tenant and model), never a hash of the whole key: the prefixes must be few
(tens to thousands) for the entropy to mean anything, and the memory and the cost of a check grow
with how many distinct prefixes the window holds.

At most once per `interval` seconds (on a `missed` or `check` call, the first call checking at
once) the entropy ``H = -sum(p * log2(p))`` of the prefixes' shares in the window is recomputed.
Below `threshold_bits`, with at least `min_misses` misses in the window (two misses of one
prefix are 0 bits and no storm), it raises a `MissStormAlert`: returned by the call that
checked, passed to `on_alert`, counted, and logged as one WARNING line (logger
``tierkv.health.miss_storm``). An empty window has no entropy (`entropy` returns None) and
raises nothing.

One storm, one alert: after an alert the detector stays quiet until a check finds no storm (the
entropy back at or above the threshold, or fewer than `min_misses` misses), which re-arms it; a
storm that lasts is reported again once per `window` seconds, so an operator who missed the
first line sees it again without a line every `interval`.

The window is `buckets` slots of ``window / buckets`` seconds: a miss leaves it between
``window - window / buckets`` and `window` seconds after it was reported. Each miss costs O(1)
amortised (a count per prefix kept incrementally, expired a slot at a time); a check costs
O(distinct prefixes in the window). Pure: the clock is passed in, time never goes back (an
earlier `now` is taken as the latest seen), and nothing but the log line leaves it. Not
thread-safe.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tierkv.config import HealthConfig

logger = logging.getLogger(__name__)

#: misses a window must hold before its entropy can raise an alert
DEFAULT_MIN_MISSES = 20
#: slots of the sliding window (1 s each for the default 60 s window)
DEFAULT_BUCKETS = 60
#: seconds between recomputations of the entropy
DEFAULT_INTERVAL = 5.0
#: bytes of a prefix shown in the log line
_SHOWN = 32


@dataclass(frozen=True, slots=True)
class MissStormAlert:
    #: when the check that raised it ran
    at: float
    #: the entropy of the window's prefixes, in bits
    bits: float
    #: the most frequent prefix and its share of the window's misses
    top_prefix: bytes
    share: float
    #: misses in the window
    misses: int


@dataclass(frozen=True, slots=True)
class MissStormSnapshot:
    #: misses reported since the detector was made
    misses: int
    #: misses and distinct prefixes in the window now
    window_misses: int
    prefixes: int
    #: the window's entropy now (None: empty window)
    bits: float | None
    #: checks run and alerts raised since the detector was made
    checks: int
    alerts: int
    #: a storm was reported and no check has seen it end yet
    alerting: bool
    last_alert: MissStormAlert | None


class _Bucket:
    __slots__ = ("counts", "index", "misses")

    def __init__(self, index: int) -> None:
        self.index = index
        self.misses = 0
        self.counts: dict[bytes, int] = {}


class MissStormDetector:
    """See the module's docstring. Raises `ValueError` for arguments out of range:
    `threshold_bits` at least 0; `window` and `interval` positive; `min_misses` and `buckets`
    at least 1."""

    def __init__(self, threshold_bits: float = 1.2, window: float = 60.0,
                 interval: float = DEFAULT_INTERVAL, *, min_misses: int = DEFAULT_MIN_MISSES,
                 buckets: int = DEFAULT_BUCKETS,
                 on_alert: Callable[[MissStormAlert], None] | None = None) -> None:
        if not (math.isfinite(threshold_bits) and threshold_bits >= 0):
            raise ValueError(f"threshold_bits must be at least 0, got {threshold_bits!r}")
        for label, seconds in (("window", window), ("interval", interval)):
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{label} must be a positive number of seconds, got {seconds!r}")
        for label, count in (("min_misses", min_misses), ("buckets", buckets)):
            if count < 1:
                raise ValueError(f"{label} must be at least 1, got {count!r}")
        self.threshold_bits = threshold_bits
        self.window = window
        self.interval = interval
        self.min_misses = min_misses
        self.buckets = buckets
        self._on_alert = on_alert
        self._width = window / buckets
        self._latest = -math.inf
        self._slots: deque[_Bucket] = deque()
        self._counts: dict[bytes, int] = {}
        self._in_window = 0
        self._next_check = -math.inf
        self._armed = True
        self._last_alert: MissStormAlert | None = None
        self._misses = self._checks = self._alerts = 0

    @classmethod
    def from_config(cls, health: HealthConfig, *, interval: float = DEFAULT_INTERVAL,
                    min_misses: int = DEFAULT_MIN_MISSES, buckets: int = DEFAULT_BUCKETS,
                    on_alert: Callable[[MissStormAlert], None] | None = None,
                    ) -> MissStormDetector:
        """A detector with the `[health]` table's `entropy_alert_bits` and `window`."""
        return cls(health.entropy_alert_bits, health.window, interval, min_misses=min_misses,
                   buckets=buckets, on_alert=on_alert)

    def missed(self, prefix: bytes, now: float) -> MissStormAlert | None:
        """Record a miss of a key starting with `prefix`; the alert if the check due now raised
        one. What `on_alert` raises propagates, the miss and the alert already recorded."""
        now = self._clock(now)
        index = self._index(now)
        self._prune(index)
        if not self._slots or self._slots[-1].index != index:
            self._slots.append(_Bucket(index))
        slot = self._slots[-1]
        slot.misses += 1
        slot.counts[prefix] = slot.counts.get(prefix, 0) + 1
        self._counts[prefix] = self._counts.get(prefix, 0) + 1
        self._in_window += 1
        self._misses += 1
        return self._check_due(now)

    def check(self, now: float) -> MissStormAlert | None:
        """Run the check if one is due (as `missed` does), without recording a miss: lets a
        caller notice that a storm ended, or that one continues, while misses are rare."""
        now = self._clock(now)
        self._prune(self._index(now))
        return self._check_due(now)

    def entropy(self, now: float) -> float | None:
        """The entropy of the window's prefixes now, in bits (None: no misses in the window);
        changes nothing but the window's expiry."""
        now = self._clock(now)
        self._prune(self._index(now))
        return self._bits()

    def snapshot(self, now: float) -> MissStormSnapshot:
        now = self._clock(now)
        self._prune(self._index(now))
        return MissStormSnapshot(
            misses=self._misses, window_misses=self._in_window, prefixes=len(self._counts),
            bits=self._bits(), checks=self._checks, alerts=self._alerts,
            alerting=not self._armed, last_alert=self._last_alert)

    def _check_due(self, now: float) -> MissStormAlert | None:
        if now < self._next_check:
            return None
        self._next_check = now + self.interval
        self._checks += 1
        bits = self._bits()
        if bits is None or self._in_window < self.min_misses or bits >= self.threshold_bits:
            self._armed = True
            return None
        last = self._last_alert
        if not self._armed and last is not None and now < last.at + self.window:
            return None  # the storm already reported, not yet a window ago
        self._armed = False
        top, count = max(self._counts.items(), key=lambda item: item[1])
        alert = MissStormAlert(at=now, bits=bits, top_prefix=top,
                               share=count / self._in_window, misses=self._in_window)
        self._last_alert = alert
        self._alerts += 1
        shown = repr(top[:_SHOWN]) + ("…" if len(top) > _SHOWN else "")
        logger.warning(
            "miss storm: %d misses in the last %g s carry %.2f bits of prefix entropy "
            "(alert below %.2f); %.0f%% of them share the prefix %s",
            alert.misses, self.window, bits, self.threshold_bits, 100 * alert.share, shown)
        if self._on_alert is not None:
            self._on_alert(alert)
        return alert

    def _bits(self) -> float | None:
        total = self._in_window
        if total == 0:
            return None
        weighted = 0.0
        for count in self._counts.values():
            share = count / total
            weighted += share * math.log2(share)
        return max(0.0 - weighted, 0.0)

    def _clock(self, now: float) -> float:
        self._latest = max(self._latest, now)
        return self._latest

    def _index(self, now: float) -> int:
        return math.floor(now / self._width)

    def _prune(self, index: int) -> None:
        slots = self._slots
        counts = self._counts
        while slots and slots[0].index <= index - self.buckets:
            slot = slots.popleft()
            self._in_window -= slot.misses
            for prefix, count in slot.counts.items():
                left = counts[prefix] - count
                if left:
                    counts[prefix] = left
                else:
                    del counts[prefix]
