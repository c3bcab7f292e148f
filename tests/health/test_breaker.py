"""The circuit breaker, pure: opening on the window's failure rate (slow successes included),
the cooldown, half-open probes, late and repeated reports, listeners and counters; then a
sequential caller checked against the rules and a state machine of concurrent permits checked
against a naive reference model. Time is passed in; nothing sleeps."""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv.config import HealthConfig
from tierkv.health import BreakerSnapshot, BreakerState, CircuitBreaker, Permit

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

#: small thresholds so that tests stay short; times and durations below are multiples of 1/4
#: (exact in binary), so no result depends on rounding
SMALL: dict[str, Any] = {"failure_rate": 0.6, "window": 10.0, "buckets": 10, "min_calls": 5,
                         "slow_operation": 0.8, "cooldown": 30.0, "close_after": 3}


class Outcome(enum.Enum):
    OK = "ok"
    FAIL = "fail"
    SLOW = "slow"  # a success after 1 s, past slow_operation


OK, FAIL, SLOW = Outcome.OK, Outcome.FAIL, Outcome.SLOW


Transition = tuple[BreakerState, BreakerState, float]


def small(**options: Any) -> tuple[CircuitBreaker, list[Transition]]:
    seen: list[Transition] = []
    breaker = CircuitBreaker(**{**SMALL, **options},
                             on_change=lambda old, new, now: seen.append((old, new, now)))
    return breaker, seen


def call(breaker: CircuitBreaker, now: float, outcome: Outcome) -> tuple[float, bool]:
    """One call admitted at `now` with `outcome`; (when it reported, whether it counted)."""
    permit = breaker.allow(now)
    assert permit is not None
    if outcome is FAIL:
        return now + 0.25, breaker.failure(permit, now + 0.25)
    end = now + (1.0 if outcome is SLOW else 0.25)
    return end, breaker.success(permit, end)


def calls(breaker: CircuitBreaker, outcomes: list[Outcome], now: float = 0.0) -> float:
    for outcome in outcomes:
        now, counted = call(breaker, now, outcome)
        assert counted
    return now


def open_at(breaker: CircuitBreaker, now: float = 0.0) -> float:
    """Open a fresh `small` breaker with failures; the time it opened."""
    end = calls(breaker, [FAIL] * breaker.min_calls, now)
    assert breaker.state(end) is OPEN
    return end


# -- opening ------------------------------------------------------------------------------------
OPENING = [
    ("below min_calls", [FAIL] * 4, CLOSED),
    ("min_calls, all failed", [FAIL] * 5, OPEN),
    ("exactly the failure rate", [OK, OK, FAIL, FAIL, FAIL], OPEN),
    ("below the failure rate", [OK, OK, OK, FAIL, FAIL], CLOSED),
    ("the rate reached later", [OK] * 4 + [FAIL] * 6, OPEN),
    ("the rate never reached", [OK] * 5 + [FAIL] * 6, CLOSED),
    ("slow successes are failures", [OK, OK, SLOW, SLOW, SLOW], OPEN),
    ("a success completing min_calls", [FAIL] * 4 + [OK], OPEN),
    ("all successes", [OK] * 30, CLOSED),
]


@pytest.mark.parametrize(("outcomes", "expected"), [row[1:] for row in OPENING],
                         ids=[row[0] for row in OPENING])
def test_the_window_failure_rate_opens_it(outcomes: list[Outcome],
                                          expected: BreakerState) -> None:
    breaker, seen = small()
    end = calls(breaker, outcomes)
    assert breaker.state(end) is expected
    assert seen == ([(CLOSED, OPEN, end)] if expected is OPEN else [])


def test_it_opens_on_the_outcome_that_reaches_the_rate() -> None:
    breaker, _ = small()
    now = calls(breaker, [OK, OK, FAIL, FAIL])
    assert breaker.state(now) is CLOSED
    now, counted = call(breaker, now, FAIL)
    assert counted
    snap = breaker.snapshot(now)
    assert (snap.state, snap.opened_at, snap.opened) == (OPEN, now, 1)


def test_failure_rate_zero_needs_one_failure() -> None:
    breaker, _ = small(failure_rate=0.0)
    now = calls(breaker, [OK] * 10)
    assert breaker.state(now) is CLOSED
    now = calls(breaker, [FAIL], now)
    assert breaker.state(now) is OPEN


def test_outcomes_leave_the_window() -> None:
    breaker, _ = small()  # 10 s in slots of 1 s
    calls(breaker, [FAIL] * 4, now=0.0)  # reported at 0.25, 0.5, 0.75 (slot 0) and 1.0 (slot 1)
    assert breaker.snapshot(9.75).window_calls == 4
    assert breaker.snapshot(10.0).window_calls == 1  # slot 0 left, 9.25 to 9.75 s after
    assert breaker.snapshot(11.0).window_calls == 0
    now = calls(breaker, [FAIL], now=11.0)
    assert breaker.state(now) is CLOSED  # 1 call in the window, not 5
    now = calls(breaker, [FAIL] * 4, now)
    assert breaker.state(now) is OPEN


def test_old_successes_leaving_raise_the_rate() -> None:
    breaker, _ = small()
    calls(breaker, [OK] * 6, now=0.0)
    now = calls(breaker, [FAIL] * 4, now=5.0)
    assert breaker.state(now) is CLOSED  # 4 of 10
    now = calls(breaker, [FAIL], now=11.0)  # the successes left: 5 of 5
    assert breaker.state(now) is OPEN


# -- open, half-open, closed --------------------------------------------------------------------
def test_open_rejects_until_the_cooldown_is_over() -> None:
    breaker, seen = small()
    opened = open_at(breaker)
    for now in (opened, opened + 1, opened + 29.75):
        assert breaker.allow(now) is None
        assert breaker.state(now) is OPEN
    assert breaker.snapshot(opened + 29.75).rejected == 3
    assert breaker.state(opened + 30) is HALF_OPEN
    assert seen[-1] == (OPEN, HALF_OPEN, opened + 30)
    probe = breaker.allow(opened + 30)
    assert probe is not None and probe.probe


def test_a_call_made_anyway_is_not_counted_as_refused() -> None:
    """A delete or a flush asks for a permit and is made without one too: the open breaker
    refused nothing, and `rejected` counted them (86 of 111 rejections in one run)."""
    breaker, _ = small()
    opened = open_at(breaker)
    assert breaker.allow(opened + 1, made_anyway=True) is None
    assert breaker.snapshot(opened + 1).rejected == 0
    assert breaker.allow(opened + 1) is None
    assert breaker.snapshot(opened + 1).rejected == 1


def test_a_call_cut_off_as_slow_counts_as_slow_and_failed() -> None:
    """A call its caller cut off at `slow_operation` is reported as a failure: it counted in
    `failures` only, and `slow` stayed 0 however slow the tier was."""
    breaker, _ = small()
    permit = breaker.allow(0.0, bounded=True)
    assert permit is not None
    breaker.failure(permit, 0.8, slow=True)
    other = breaker.allow(1.0)
    assert other is not None
    breaker.failure(other, 1.25)  # an error: failed, not slow
    snapshot = breaker.snapshot(1.25)
    assert (snapshot.failures, snapshot.slow) == (2, 1)


def test_half_open_admits_max_probes_at_once() -> None:
    for max_probes in (1, 2):
        breaker, _ = small(max_probes=max_probes)
        now = open_at(breaker) + 30
        probes = [breaker.allow(now) for _ in range(max_probes)]
        assert all(p is not None and p.probe for p in probes)
        assert breaker.allow(now) is None
        assert breaker.snapshot(now).probes == max_probes


@pytest.mark.parametrize("close_after", [1, 3, 5])
def test_close_after_consecutive_successful_probes(close_after: int) -> None:
    breaker, seen = small(close_after=close_after)
    now = open_at(breaker) + 30
    for done in range(1, close_after + 1):
        assert breaker.state(now) is HALF_OPEN
        now, counted = call(breaker, now, OK)
        assert counted
        assert breaker.state(now) is (CLOSED if done == close_after else HALF_OPEN)
    assert seen[-1] == (HALF_OPEN, CLOSED, now)
    snap = breaker.snapshot(now)
    assert (snap.closed, snap.window_calls) == (1, 0)  # closes with an empty window
    assert breaker.allow(now) is not None


@pytest.mark.parametrize("bad", [FAIL, SLOW])
def test_a_bad_probe_reopens_and_restarts_the_cooldown(bad: Outcome) -> None:
    breaker, seen = small()
    now = open_at(breaker) + 30
    now = calls(breaker, [OK, OK], now)
    reopened, counted = call(breaker, now, bad)
    assert counted
    assert seen[-1] == (HALF_OPEN, OPEN, reopened)
    assert breaker.allow(reopened + 29.75) is None
    assert breaker.state(reopened + 30) is HALF_OPEN
    # the streak starts over: close_after fresh successes are needed
    now = calls(breaker, [OK, OK], reopened + 30)
    assert breaker.state(now) is HALF_OPEN
    now = calls(breaker, [OK], now)
    assert breaker.state(now) is CLOSED
    assert breaker.snapshot(now).opened == 2


def test_an_unreported_probe_counts_as_slow_once_overdue() -> None:
    breaker, seen = small()
    half = open_at(breaker) + 30
    probe = breaker.allow(half)
    assert probe is not None and probe.deadline == half + 0.8
    assert breaker.allow(half + 0.75) is None  # still in flight
    before = breaker.snapshot(half + 0.75)
    assert breaker.allow(half + 1.0) is None  # overdue: presumed failed, open again
    assert probe.settled
    after = breaker.snapshot(half + 1.0)
    assert (after.state, after.opened_at) == (OPEN, half + 1.0)
    assert (after.calls - before.calls, after.failures - before.failures,
            after.slow - before.slow) == (1, 1, 1)
    assert seen[-1] == (HALF_OPEN, OPEN, half + 1.0)
    assert not breaker.success(probe, half + 1.25)  # its report comes too late to count
    assert breaker.snapshot(half + 1.25).late == 0  # already counted as slow


def test_a_bounded_probe_is_left_to_its_caller_past_the_deadline() -> None:
    # its caller cuts it off and reports it itself (after a stall of its loop, past the
    # deadline the breaker's clock sees): the report counts, and may close the breaker
    breaker, _ = small()
    half = open_at(breaker) + 30
    probe = breaker.allow(half, bounded=True)
    assert probe is not None
    assert breaker.state(half + 1.5) is HALF_OPEN and not probe.settled
    assert breaker.success(probe, half + 1.6, slow=False)
    now = calls(breaker, [OK] * (breaker.close_after - 1), half + 1.6)
    assert breaker.state(now) is CLOSED


def test_a_success_judged_by_its_caller_is_not_slow() -> None:
    breaker, _ = small()
    permit = breaker.allow(0.0)
    assert permit is not None
    assert breaker.success(permit, 5.0, slow=False)
    snapshot = breaker.snapshot(5.0)
    assert (snapshot.calls, snapshot.failures, snapshot.slow) == (1, 0, 0)


def test_cancel_frees_the_probe_slot_and_counts_nothing() -> None:
    breaker, _ = small()
    now = open_at(breaker) + 30
    probe = breaker.allow(now)
    assert probe is not None
    before = breaker.snapshot(now)
    assert breaker.cancel(probe)
    assert not breaker.cancel(probe)
    assert not breaker.success(probe, now)
    after = breaker.snapshot(now)
    assert (after.calls, after.failures, after.late, after.probes) == (
        before.calls, before.failures, before.late, 0)
    assert breaker.allow(now) is not None


# -- late and repeated reports ------------------------------------------------------------------
def test_late_results_while_open_change_nothing() -> None:
    breaker, _ = small()
    stragglers = [breaker.allow(0.0) for _ in range(3)]
    opened = open_at(breaker)
    for permit in stragglers:
        assert permit is not None
        assert not breaker.success(permit, opened + 1)
    snap = breaker.snapshot(opened + 1)
    assert (snap.state, snap.late, snap.closed) == (OPEN, 3, 0)


def test_a_late_failure_while_half_open_does_not_reopen() -> None:
    breaker, seen = small()
    straggler = breaker.allow(0.0)
    assert straggler is not None
    half = open_at(breaker) + 30
    assert breaker.state(half) is HALF_OPEN
    assert not breaker.failure(straggler, half)
    assert breaker.state(half) is HALF_OPEN
    assert seen[-1] == (OPEN, HALF_OPEN, half)
    now = calls(breaker, [OK, OK, OK], half)
    assert breaker.state(now) is CLOSED


def test_results_from_before_an_open_never_enter_a_later_window() -> None:
    breaker, _ = small()
    stragglers = [breaker.allow(0.0) for _ in range(5)]
    now = calls(breaker, [OK, OK, OK], open_at(breaker) + 30)
    assert breaker.state(now) is CLOSED
    for permit in stragglers:
        assert permit is not None
        assert not breaker.failure(permit, now)
    snap = breaker.snapshot(now)
    assert (snap.state, snap.window_calls, snap.late) == (CLOSED, 0, 5)


def test_a_probe_of_an_earlier_half_open_is_late() -> None:
    breaker, _ = small(max_probes=2)
    half = open_at(breaker) + 30
    first, second = breaker.allow(half), breaker.allow(half)
    assert first is not None and second is not None
    assert breaker.failure(first, half + 0.25)  # reopens
    later = half + 0.25 + 30
    assert breaker.state(later) is HALF_OPEN
    assert not breaker.success(second, later)  # belongs to the previous half-open
    snap = breaker.snapshot(later)
    assert (snap.state, snap.probes, snap.late) == (HALF_OPEN, 0, 1)


def test_only_the_first_report_of_a_permit_counts() -> None:
    breaker, _ = small()
    permit = breaker.allow(0.0)
    assert permit is not None
    assert breaker.failure(permit, 0.8)  # the caller gave up at the deadline
    assert not breaker.success(permit, 5.0)  # the operation finished in the background
    assert not breaker.failure(permit, 5.0)
    snap = breaker.snapshot(5.0)
    assert (snap.calls, snap.failures, snap.late) == (1, 1, 0)


def test_a_permit_of_another_breaker_is_refused() -> None:
    one, _ = small()
    other, _ = small()
    permit = one.allow(0.0)
    assert permit is not None
    reports: list[Callable[[], bool]] = [lambda: other.success(permit, 1.0),
                                         lambda: other.failure(permit, 1.0),
                                         lambda: other.cancel(permit)]
    for report in reports:
        with pytest.raises(ValueError):
            report()
    assert not permit.settled


# -- time, counters, configuration --------------------------------------------------------------
def test_slowness_is_measured_from_allow_to_the_report() -> None:
    breaker, _ = small(slow_operation=0.75)  # exact in binary, so the boundary is exact
    for start, duration, slow_so_far in ((0.0, 0.5, 0), (10.0, 0.75, 0), (20.0, 0.875, 1),
                                         (30.0, 5.0, 2)):
        permit = breaker.allow(start)
        assert permit is not None
        assert breaker.success(permit, start + duration)
        snap = breaker.snapshot(start + duration)
        assert (snap.slow, snap.failures) == (slow_so_far, slow_so_far)


def test_time_never_goes_back() -> None:
    breaker, _ = small()
    permit = breaker.allow(10.0)
    assert permit is not None
    breaker.snapshot(12.0)
    assert breaker.success(permit, 10.5)  # taken as 12.0: 2 s after `allow`, slow
    snap = breaker.snapshot(10.5)
    assert (snap.calls, snap.slow, snap.window_calls) == (1, 1, 1)
    assert breaker.snapshot(21.75).window_calls == 1  # in the slot of 12.0, not of 10.5
    assert breaker.snapshot(22.0).window_calls == 0
    opened = open_at(breaker, 30.0)
    assert breaker.allow(opened - 5) is None  # still open: that is not before it opened


def test_snapshot_counts_everything() -> None:
    breaker, _ = small(name="nvme0")
    opened = calls(breaker, [OK, SLOW, FAIL, FAIL, FAIL])  # 4 of 5 failed
    assert breaker.allow(opened) is None
    now = calls(breaker, [OK, OK, OK], opened + 30)
    snap = breaker.snapshot(now)
    assert snap == BreakerSnapshot(
        name="nvme0", state=CLOSED, opened_at=opened, window_calls=0, window_failures=0,
        probes=0, opened=1, closed=1, half_opened=1, calls=5 + 3, failures=4, slow=1,
        rejected=1, late=0)


def test_state_changes_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    breaker, _ = small(name="pmem0")
    with caplog.at_level(logging.INFO, logger="tierkv.health"):
        now = calls(breaker, [OK, OK, OK], open_at(breaker) + 30)
    assert breaker.state(now) is CLOSED
    levels = [(r.name, r.levelno, r.getMessage().split(":")[0]) for r in caplog.records]
    assert levels == [("tierkv.health.breaker", logging.WARNING, "circuit breaker pmem0"),
                      ("tierkv.health.breaker", logging.INFO, "circuit breaker pmem0"),
                      ("tierkv.health.breaker", logging.INFO, "circuit breaker pmem0")]


def test_from_config_takes_the_health_table() -> None:
    health = HealthConfig(failure_rate=0.5, window=30.0, slow_operation=0.25, cooldown=60.0,
                          close_after=2)
    breaker = CircuitBreaker.from_config(health, min_calls=4, name="redis")
    assert (breaker.failure_rate, breaker.window, breaker.slow_operation, breaker.cooldown,
            breaker.close_after, breaker.min_calls, breaker.name) == (
        0.5, 30.0, 0.25, 60.0, 2, 4, "redis")
    defaults = CircuitBreaker.from_config(HealthConfig())
    assert (defaults.failure_rate, defaults.window, defaults.slow_operation, defaults.cooldown,
            defaults.close_after, defaults.min_calls) == (0.6, 60.0, 0.8, 300.0, 3, 20)


@pytest.mark.parametrize("options", [
    {"failure_rate": -0.1}, {"failure_rate": 1.5}, {"window": 0.0}, {"window": math.inf},
    {"slow_operation": -1.0}, {"cooldown": 0.0}, {"close_after": 0}, {"min_calls": 0},
    {"max_probes": 0}, {"buckets": 0}, {"failure_rate": math.nan},
])
def test_arguments_out_of_range_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(**options)


# -- a sequential caller against the rules ------------------------------------------------------
WIDTH: float = SMALL["window"] / SMALL["buckets"]
QUARTERS = st.integers(0, 48).map(lambda n: n / 4)  # 0 .. 12 s
STEPS = st.tuples(st.one_of(QUARTERS, st.sampled_from([29.75, 30.0, 31.0])), st.booleans(),
                  st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 2.0]))


def in_window(reported: float, now: float) -> bool:
    """The documented window: slots of `WIDTH` seconds, the last `buckets` of them."""
    buckets: int = SMALL["buckets"]
    return math.floor(reported / WIDTH) > math.floor(now / WIDTH) - buckets


@settings(max_examples=200, deadline=None)
@given(st.lists(STEPS, max_size=150))
def test_a_sequential_caller_sees_the_rules(steps: list[tuple[float, bool, float]]) -> None:
    breaker, seen = small()
    now = 0.0
    outcomes: list[tuple[float, bool]] = []  # since the breaker last closed
    opened_at = -math.inf
    streak = reports = failures = slow = 0
    for dt, ok, duration in steps:
        now += dt
        before = len(seen)
        state = breaker.state(now)
        if state is HALF_OPEN and seen[before:]:
            assert seen[before:] == [(OPEN, HALF_OPEN, now)]
            assert now >= opened_at + SMALL["cooldown"]
            streak = 0
        if state is OPEN:
            assert now < opened_at + SMALL["cooldown"]
        permit = breaker.allow(now)
        if state is OPEN:
            assert permit is None
            continue
        assert permit is not None and permit.probe == (state is HALF_OPEN)
        now += duration
        before = len(seen)
        assert breaker.success(permit, now) if ok else breaker.failure(permit, now)
        changes = seen[before:]
        bad = not ok or duration > SMALL["slow_operation"]
        reports += 1
        failures += bad
        slow += ok and duration > SMALL["slow_operation"]
        if state is CLOSED:
            outcomes.append((now, bad))
            window = [failed for reported, failed in outcomes if in_window(reported, now)]
            should_open = (any(window) and len(window) >= SMALL["min_calls"]
                           and sum(window) / len(window) >= SMALL["failure_rate"])
            assert changes == ([(CLOSED, OPEN, now)] if should_open else [])
        elif bad:
            assert changes == [(HALF_OPEN, OPEN, now)]
        else:
            streak += 1
            closes = streak == SMALL["close_after"]
            assert changes == ([(HALF_OPEN, CLOSED, now)] if closes else [])
            if closes:
                outcomes.clear()
        if changes and changes[-1][1] is OPEN:
            opened_at = now
    snap = breaker.snapshot(now)
    assert (snap.calls, snap.failures, snap.slow, snap.late) == (reports, failures, slow, 0)


# -- concurrent permits against a reference model -----------------------------------------------
MODEL: dict[str, Any] = {**SMALL, "failure_rate": 0.5, "buckets": 5, "min_calls": 3,
                         "close_after": 2, "max_probes": 2, "cooldown": 4.0}
MODEL_WIDTH: float = MODEL["window"] / MODEL["buckets"]


@dataclass(eq=False)
class ModelPermit:
    generation: int
    issued: float
    probe: bool
    settled: bool = False


@dataclass
class Model:
    """The rules written out naively: every outcome since the last change kept in a list and
    the window filtered from it on each report."""

    state: BreakerState = CLOSED
    generation: int = 0
    opened_at: float | None = None
    events: list[tuple[float, bool]] = field(default_factory=list)
    probes: list[ModelPermit] = field(default_factory=list)
    successes: int = 0
    transitions: list[Transition] = field(default_factory=list)
    #: (calls, failures) of the window at each opening from CLOSED; streaks at each closing
    openings: list[tuple[int, int]] = field(default_factory=list)
    closings: list[int] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def window(self, now: float) -> tuple[int, int]:
        current = math.floor(now / MODEL_WIDTH)
        kept = [failed for reported, failed in self.events
                if math.floor(reported / MODEL_WIDTH) > current - MODEL["buckets"]]
        return len(kept), sum(kept)

    def change(self, new: BreakerState, now: float) -> None:
        self.transitions.append((self.state, new, now))
        self.state = new
        self.generation += 1
        self.probes = []
        self.successes = 0
        self.events = []
        if new is OPEN:
            self.opened_at = now
        self.counts[{OPEN: "opened", CLOSED: "closed", HALF_OPEN: "half_opened"}[new]] += 1

    def advance(self, now: float) -> None:
        if (self.state is OPEN and self.opened_at is not None
                and now >= self.opened_at + MODEL["cooldown"]):
            self.change(HALF_OPEN, now)
        if self.state is HALF_OPEN:
            overdue = [p for p in self.probes if now > p.issued + MODEL["slow_operation"]]
            for p in overdue:
                p.settled = True
                self.counts.update(calls=1, failures=1, slow=1)
            if overdue:
                self.change(OPEN, now)

    def allow(self, now: float) -> ModelPermit | None:
        self.advance(now)
        if self.state is CLOSED:
            return ModelPermit(self.generation, now, probe=False)
        if self.state is HALF_OPEN and len(self.probes) < MODEL["max_probes"]:
            self.probes.append(ModelPermit(self.generation, now, probe=True))
            return self.probes[-1]
        self.counts["rejected"] += 1
        return None

    def report(self, permit: ModelPermit, now: float, failed: bool) -> bool:
        if permit.settled:
            return False
        permit.settled = True
        if permit in self.probes:
            self.probes.remove(permit)
        if permit.generation != self.generation:
            self.counts["late"] += 1
            self.advance(now)
            return False
        slow = not failed and now - permit.issued > MODEL["slow_operation"]
        bad = failed or slow
        self.counts.update(calls=1, failures=int(bad), slow=int(slow))
        if permit.probe:
            if bad:
                self.change(OPEN, now)
            else:
                self.successes += 1
                if self.successes >= MODEL["close_after"]:
                    self.closings.append(self.successes)
                    self.change(CLOSED, now)
        else:
            self.events.append((now, bad))
            calls_, failures = self.window(now)
            if (failures and calls_ >= MODEL["min_calls"]
                    and failures / calls_ >= MODEL["failure_rate"]):
                self.openings.append((calls_, failures))
                self.change(OPEN, now)
        self.advance(now)
        return True

    def cancel(self, permit: ModelPermit) -> bool:
        if permit.settled:
            return False
        permit.settled = True
        if permit in self.probes:
            self.probes.remove(permit)
        return True


class Report(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    CANCEL = "cancel"


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.seen: list[Transition] = []
        self.breaker = CircuitBreaker(
            **MODEL, on_change=lambda old, new, now: self.seen.append((old, new, now)))
        self.model = Model()
        self.outstanding: list[tuple[Permit, ModelPermit]] = []
        self.done: list[tuple[Permit, ModelPermit]] = []

    def report(self, pair: tuple[Permit, ModelPermit], kind: Report) -> None:
        permit, shadow = pair
        if kind is Report.CANCEL:
            assert self.breaker.cancel(permit) == self.model.cancel(shadow)
            return
        failed = kind is Report.FAILURE
        report = self.breaker.failure if failed else self.breaker.success
        assert report(permit, self.now) == self.model.report(shadow, self.now, failed)

    @rule(dt=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 5.0, 31.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def allow(self) -> None:
        self.admit()

    def admit(self) -> tuple[Permit, ModelPermit] | None:
        model = self.model
        cooling = (model.state is OPEN and model.opened_at is not None
                   and self.now < model.opened_at + MODEL["cooldown"])
        permit, shadow = self.breaker.allow(self.now), model.allow(self.now)
        assert (permit is None) == (shadow is None)
        if cooling:
            assert permit is None
        if permit is not None and shadow is not None:
            assert (permit.probe, permit.issued) == (shadow.probe, shadow.issued)
            self.outstanding.append((permit, shadow))
            return permit, shadow
        return None

    @rule(kind=st.sampled_from([Report.SUCCESS, Report.FAILURE]))
    def quick_call(self, kind: Report) -> None:
        """A whole call of 0.25 s: reaches the states that take many calls in fewer steps."""
        pair = self.admit()
        if pair is not None:
            self.outstanding.remove(pair)
            self.now += 0.25
            self.report(pair, kind)
            self.done.append(pair)

    @precondition(lambda self: self.outstanding)
    @rule(choice=st.integers(0, 63), kind=st.sampled_from(Report))
    def settle(self, choice: int, kind: Report) -> None:
        pair = self.outstanding.pop(choice % len(self.outstanding))
        self.report(pair, kind)
        self.done.append(pair)

    @precondition(lambda self: self.done)
    @rule(choice=st.integers(0, 63), kind=st.sampled_from(Report))
    def settle_again(self, choice: int, kind: Report) -> None:
        before = self.breaker.snapshot(self.now)
        self.report(self.done[choice % len(self.done)], kind)
        assert self.breaker.snapshot(self.now) == before

    @invariant()
    def agrees_with_the_model(self) -> None:
        snap = self.breaker.snapshot(self.now)
        model = self.model
        model.advance(self.now)
        calls_, failures = model.window(self.now)
        counts = model.counts
        assert (snap.state, snap.opened_at, snap.probes) == (
            model.state, model.opened_at, len(model.probes))
        assert (snap.window_calls, snap.window_failures) == (calls_, failures)
        assert (snap.opened, snap.closed, snap.half_opened) == (
            counts["opened"], counts["closed"], counts["half_opened"])
        assert (snap.calls, snap.failures, snap.slow, snap.rejected, snap.late) == (
            counts["calls"], counts["failures"], counts["slow"], counts["rejected"],
            counts["late"])
        assert self.seen == model.transitions
        assert [p.settled for p, _ in self.outstanding] == [s.settled for _, s in self.outstanding]

    @invariant()
    def keeps_the_rules(self) -> None:
        assert self.breaker.snapshot(self.now).probes <= MODEL["max_probes"]
        for calls_, failures in self.model.openings:
            assert calls_ >= MODEL["min_calls"] and failures / calls_ >= MODEL["failure_rate"]
        assert all(streak == MODEL["close_after"] for streak in self.model.closings)


TestBreakerMachine = BreakerMachine.TestCase
TestBreakerMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
