"""A circuit breaker for one tier: a pure state machine, the clock passed in on every call.

CLOSED: every call is admitted. Each outcome is counted in a sliding window of `window` seconds;
after each outcome, if the window holds at least `min_calls` outcomes, at least one of them
failed, and the share of failures reaches `failure_rate`, the breaker opens. A success slower
than `slow_operation` (from `allow` to its report) counts as a failure.

OPEN: nothing is admitted (callers skip the tier) until `cooldown` seconds have passed since it
opened; the first call after that finds it HALF_OPEN.

HALF_OPEN: at most `max_probes` calls (probes) are in flight at once; `close_after` consecutive
successful probes close it (with an empty window), and any failed or slow probe opens it again
(the cooldown starts over). A probe left unreported for longer than `slow_operation` is slow by
definition: the next call to the breaker counts it as failed, so a caller that drops a permit
cannot wedge the breaker half-open — unless it was admitted `bounded`: its caller cuts the call
off itself and always reports it (the engine's cut-off, which gives back what stalls of its own
event loop took, and so may report after the deadline the breaker's clock sees pass).

A caller asks `allow(now)` just before the operation, gets a `Permit` (or None: skip the tier),
and reports the outcome exactly once with `success`, `failure` or `cancel` (not the device's
fault, e.g. the request itself was cancelled). A caller that stops waiting at
`permit.deadline` reports `failure` then; the first report of a permit counts and later ones
are ignored, so the operation completing in the background may still report harmlessly.

Every state change starts a new generation; a permit reports into the generation that issued it
or not at all. Results of calls admitted before a change (late results) are counted in `late`
and change nothing: a late success while OPEN does not close it, a late failure while HALF_OPEN
does not re-open it, and outcomes from before an open never enter the window after it closes.

The window is `buckets` slots of ``window / buckets`` seconds each, so an outcome leaves it
between ``window - window / buckets`` and `window` seconds after it was reported; each call costs
O(1) amortised and the memory is bounded by `buckets`, whatever the call rate.

Time never goes back: a `now` earlier than one already seen is taken as the latest seen. Not
thread-safe: one event loop (or one lock) owns a breaker. No IO except log lines on state
changes (logger ``tierkv.health.breaker``: opening at WARNING, the others at INFO).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tierkv.config import HealthConfig

logger = logging.getLogger(__name__)

#: outcomes a window must hold before its failure rate can open the breaker
DEFAULT_MIN_CALLS = 20
#: slots of the sliding window (1 s each for the default 60 s window)
DEFAULT_BUCKETS = 60


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


#: called after each state change with ``(old, new, now)``, the breaker already consistent;
#: what it raises propagates to the caller of the breaker method that made the change
Listener = Callable[[BreakerState, BreakerState, float], None]


class Permit:
    """The ticket for one admitted call; report its outcome once to the breaker that issued it.

    `deadline` is when the call becomes slow (``issued + slow_operation``): a caller that does
    not want to wait longer reports `failure` then and lets the operation finish on its own.
    """

    __slots__ = ("_bounded", "_deadline", "_generation", "_issued", "_owner", "_probe",
                 "_settled")

    def __init__(self, owner: CircuitBreaker, generation: int, issued: float, deadline: float,
                 probe: bool, *, bounded: bool = False) -> None:
        self._owner = owner
        self._generation = generation
        self._issued = issued
        self._deadline = deadline
        self._probe = probe
        self._bounded = bounded
        self._settled = False

    @property
    def issued(self) -> float:
        return self._issued

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def probe(self) -> bool:
        """Whether it was admitted as a half-open probe."""
        return self._probe

    @property
    def settled(self) -> bool:
        """Whether an outcome (or a cancel) was reported, or the breaker expired the probe."""
        return self._settled

    def __repr__(self) -> str:
        return (f"Permit(issued={self._issued}, probe={self._probe}, "
                f"settled={self._settled})")


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """A breaker's state and counters at one time (for `stats()` and metrics)."""

    name: str
    state: BreakerState
    #: when it last opened (None: never)
    opened_at: float | None
    #: outcomes and failures in the sliding window now (CLOSED only; 0 otherwise)
    window_calls: int
    window_failures: int
    #: probes in flight (HALF_OPEN only)
    probes: int
    #: state changes since the breaker was made
    opened: int
    closed: int
    half_opened: int
    #: outcomes that counted (successes, failures and expired probes)
    calls: int
    #: failed outcomes, the slow ones included
    failures: int
    #: successes and expired probes that were slower than `slow_operation`
    slow: int
    #: `allow` calls answered with None
    rejected: int
    #: outcomes reported after a state change, which counted for nothing
    late: int


class _Bucket:
    __slots__ = ("calls", "failures", "index")

    def __init__(self, index: int) -> None:
        self.index = index
        self.calls = 0
        self.failures = 0


class CircuitBreaker:
    """See the module's docstring for the rules; every argument is keyword-only.

    Raises `ValueError` for arguments out of range: `failure_rate` in [0, 1]; `window`,
    `slow_operation` and `cooldown` positive; `close_after`, `min_calls`, `max_probes` and
    `buckets` at least 1.
    """

    def __init__(self, *, failure_rate: float = 0.6, window: float = 60.0,
                 slow_operation: float = 0.8, cooldown: float = 300.0, close_after: int = 3,
                 min_calls: int = DEFAULT_MIN_CALLS, max_probes: int = 1,
                 buckets: int = DEFAULT_BUCKETS, name: str = "tier",
                 on_change: Listener | None = None) -> None:
        if not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be in [0, 1], got {failure_rate!r}")
        for label, seconds in (("window", window), ("slow_operation", slow_operation),
                               ("cooldown", cooldown)):
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{label} must be a positive number of seconds, got {seconds!r}")
        for label, count in (("close_after", close_after), ("min_calls", min_calls),
                             ("max_probes", max_probes), ("buckets", buckets)):
            if count < 1:
                raise ValueError(f"{label} must be at least 1, got {count!r}")
        self.name = name
        self.failure_rate = failure_rate
        self.window = window
        self.slow_operation = slow_operation
        self.cooldown = cooldown
        self.close_after = close_after
        self.min_calls = min_calls
        self.max_probes = max_probes
        self.buckets = buckets
        self._on_change = on_change
        self._width = window / buckets
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._latest = -math.inf
        self._opened_at: float | None = None
        self._window: deque[_Bucket] = deque()
        self._window_calls = self._window_failures = 0
        self._probes: set[Permit] = set()
        self._successes = 0  # consecutive successful probes
        self._opened = self._closed = self._half_opened = 0
        self._calls = self._failures = self._slow = self._rejected = self._late = 0

    @classmethod
    def from_config(cls, health: HealthConfig, *, min_calls: int = DEFAULT_MIN_CALLS,
                    max_probes: int = 1, buckets: int = DEFAULT_BUCKETS, name: str = "tier",
                    on_change: Listener | None = None) -> CircuitBreaker:
        """A breaker with the thresholds of the `[health]` table."""
        return cls(failure_rate=health.failure_rate, window=health.window,
                   slow_operation=health.slow_operation, cooldown=health.cooldown,
                   close_after=health.close_after, min_calls=min_calls, max_probes=max_probes,
                   buckets=buckets, name=name, on_change=on_change)

    # -- the caller's side ------------------------------------------------------------------
    def allow(self, now: float, *, bounded: bool = False,
              made_anyway: bool = False) -> Permit | None:
        """A permit for one call starting now, or None: skip the tier (counted in `rejected`).
        `bounded`: the caller cuts the call off and reports it itself, so a probe of it is not
        expired by this breaker's clock (the module docstring). `made_anyway`: made without a
        permit too (a delete, a flush): a None refuses nothing, and is not counted."""
        now = self._clock(now)
        if self._state is BreakerState.CLOSED:  # time changes nothing in a closed breaker
            return Permit(self, self._generation, now, now + self.slow_operation, False,
                          bounded=bounded)
        self._advance(now)
        deadline = now + self.slow_operation
        if self._state is BreakerState.HALF_OPEN and len(self._probes) < self.max_probes:
            permit = Permit(self, self._generation, now, deadline, probe=True, bounded=bounded)
            self._probes.add(permit)
            return permit
        self._rejected += not made_anyway
        return None

    def success(self, permit: Permit, now: float, *, slow: bool | None = None) -> bool:
        """The call of `permit` succeeded now; slower than `slow_operation` it counts as failed.
        `slow`: whether it was, where the caller judged that itself (a cut-off that gives back
        what stalls of the caller's own event loop took); ``None``: from its issue to `now`.

        Returns whether the outcome counted: False for a permit already settled or a late
        result (issued before a state change). Raises `ValueError` for another breaker's permit.
        """
        return self._report(permit, now, failed=False, slow=slow)

    def failure(self, permit: Permit, now: float, *, slow: bool = False) -> bool:
        """The call of `permit` failed now (or the caller gave up waiting); as `success`; `slow`:
        it was cut off at `slow_operation` (counted in `slow` too)."""
        return self._report(permit, now, failed=True, slow=slow)

    def cancel(self, permit: Permit) -> bool:
        """The call of `permit` ended without a verdict on the device (the request itself was
        cancelled): it frees its probe slot and counts nowhere. Returns whether it was unsettled.
        """
        self._check_owner(permit)
        if permit._settled:
            return False
        permit._settled = True
        self._probes.discard(permit)
        return True

    # -- observers --------------------------------------------------------------------------
    def state(self, now: float) -> BreakerState:
        """The state at `now` (an open breaker whose cooldown is over is half-open)."""
        now = self._clock(now)
        self._advance(now)
        return self._state

    @property
    def failures(self) -> int:
        """Outcomes reported failed so far (what `snapshot` counts, without its upkeep)."""
        return self._failures

    def snapshot(self, now: float) -> BreakerSnapshot:
        now = self._clock(now)
        self._advance(now)
        self._prune(self._index(now))
        return BreakerSnapshot(
            name=self.name, state=self._state, opened_at=self._opened_at,
            window_calls=self._window_calls, window_failures=self._window_failures,
            probes=len(self._probes), opened=self._opened, closed=self._closed,
            half_opened=self._half_opened, calls=self._calls, failures=self._failures,
            slow=self._slow, rejected=self._rejected, late=self._late)

    # -- the machine ------------------------------------------------------------------------
    def _clock(self, now: float) -> float:
        self._latest = max(self._latest, now)
        return self._latest

    def _check_owner(self, permit: Permit) -> None:
        if permit._owner is not self:
            raise ValueError(f"{permit!r} was issued by another breaker")

    def _report(self, permit: Permit, now: float, *, failed: bool,
                slow: bool | None = None) -> bool:
        self._check_owner(permit)
        now = self._clock(now)
        if permit._settled:
            return False
        permit._settled = True
        if (not failed and not permit._probe and permit._generation == self._generation
                and (slow is False
                     or (slow is None and now - permit._issued <= self.slow_operation))
                and self._count_success(now)):
            return True
        self._probes.discard(permit)
        if permit._generation != self._generation:
            self._late += 1
            self._advance(now)
            return False
        # judged before `_advance` so that its own lateness is measured, not presumed
        if slow is None:  # a failure is slow only where its caller says so (a cut-off)
            slow = not failed and now - permit._issued > self.slow_operation
        self._count(failed or slow, slow)
        if permit._probe:
            self._judge_probe(now, failed or slow)
        else:
            self._judge_call(now, failed or slow)
        self._advance(now)
        return True

    def _count_success(self, now: float) -> bool:
        """The common outcome in few steps (every guarded call of a healthy tier reports one):
        a success, not slow, of a call admitted in this state, landing in the window's newest
        bucket while the window holds no failure. In that bucket nothing is left to prune (the
        report that made it pruned for its index), a window without failures cannot trip (with
        failures, the success that reaches `min_calls` may), and a closed breaker's `_advance`
        does nothing. False: take the general path."""
        window = self._window
        if (self._state is not BreakerState.CLOSED or self._window_failures or not window
                or window[-1].index != self._index(now)):
            return False
        window[-1].calls += 1
        self._window_calls += 1
        self._calls += 1
        return True

    def _count(self, failed: bool, slow: bool) -> None:
        self._calls += 1
        self._failures += failed
        self._slow += slow

    def _judge_call(self, now: float, failed: bool) -> None:
        index = self._index(now)
        self._prune(index)
        if not self._window or self._window[-1].index != index:
            self._window.append(_Bucket(index))
        bucket = self._window[-1]
        bucket.calls += 1
        bucket.failures += failed
        self._window_calls += 1
        self._window_failures += failed
        if (self._window_failures and self._window_calls >= self.min_calls
                and self._window_failures / self._window_calls >= self.failure_rate):
            self._change(BreakerState.OPEN, now,
                         f"{self._window_failures} of {self._window_calls} calls failed "
                         f"in {self.window:g} s")

    def _judge_probe(self, now: float, failed: bool) -> None:
        if failed:
            self._change(BreakerState.OPEN, now, "a probe failed")
            return
        self._successes += 1
        if self._successes >= self.close_after:
            self._change(BreakerState.CLOSED, now, f"{self._successes} probes succeeded")

    def _advance(self, now: float) -> None:
        """The changes time makes: the cooldown ends; unreported probes become overdue."""
        if (self._state is BreakerState.OPEN and self._opened_at is not None
                and now >= self._opened_at + self.cooldown):
            self._change(BreakerState.HALF_OPEN, now, f"{self.cooldown:g} s cooldown over")
        if self._state is BreakerState.HALF_OPEN:
            overdue = [permit for permit in self._probes
                       if not permit._bounded and now > permit._deadline]
            if overdue:
                for permit in overdue:
                    permit._settled = True
                    self._count(failed=True, slow=True)
                self._change(BreakerState.OPEN, now,
                             f"a probe went unreported past {self.slow_operation:g} s")

    def _change(self, new: BreakerState, now: float, reason: str) -> None:
        old = self._state
        self._state = new
        self._generation += 1
        # outstanding permits belong to the old generation now: their results will be late
        self._probes.clear()
        self._successes = 0
        self._window.clear()
        self._window_calls = self._window_failures = 0
        if new is BreakerState.OPEN:
            self._opened_at = now
            self._opened += 1
        elif new is BreakerState.HALF_OPEN:
            self._half_opened += 1
        else:
            self._closed += 1
        logger.log(logging.WARNING if new is BreakerState.OPEN else logging.INFO,
                   "circuit breaker %s: %s -> %s (%s)", self.name, old.value, new.value, reason)
        if self._on_change is not None:
            self._on_change(old, new, now)

    def _index(self, now: float) -> int:
        return math.floor(now / self._width)

    def _prune(self, index: int) -> None:
        window = self._window
        while window and window[0].index <= index - self.buckets:
            bucket = window.popleft()
            self._window_calls -= bucket.calls
            self._window_failures -= bucket.failures
