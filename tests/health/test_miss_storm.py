"""The miss-storm detector, pure: the entropy of missed-key prefixes against the formula (the
issue's two distributions among them), the minimum of misses, expiry from the window, the check
interval, one alert per storm, the callback and the log line. Time is passed in."""

from __future__ import annotations

import logging
import math
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tierkv.config import HealthConfig
from tierkv.health import MissStormAlert, MissStormDetector


def shannon(counts: list[int]) -> float:
    """-sum(p log2 p), written out."""
    total = sum(counts)
    return -sum(c / total * math.log2(c / total) for c in counts if c)


def feed(detector: MissStormDetector, counts: dict[bytes, int], now: float) -> None:
    """`counts` misses per prefix at `now`, interleaved; ignores what the checks say."""
    left = dict(counts)
    while left:
        for prefix in list(left):
            detector.missed(prefix, now)
            left[prefix] -= 1
            if not left[prefix]:
                del left[prefix]


def prefixes(*counts: int) -> dict[bytes, int]:
    """``tenant-<i>/`` misses `counts[i]` times (0: the prefix is absent)."""
    return {f"tenant-{i}/".encode(): count for i, count in enumerate(counts) if count}


def test_three_even_prefixes_are_log2_3_bits_and_no_storm() -> None:
    detector = MissStormDetector()
    feed(detector, prefixes(40, 40, 40), now=0.0)
    bits = detector.entropy(0.0)
    assert bits == pytest.approx(1.58, abs=0.01)
    assert bits == pytest.approx(math.log2(3), abs=1e-12)
    assert detector.check(5.0) is None
    assert detector.snapshot(5.0).alerts == 0


def test_a_95_percent_flood_is_about_0_3_bits_and_a_storm() -> None:
    alerts: list[MissStormAlert] = []
    detector = MissStormDetector(on_alert=alerts.append)
    feed(detector, prefixes(950, 30, 20), now=0.0)  # 95 %, the rest over two others
    bits = detector.entropy(0.0)
    assert bits == pytest.approx(0.3, abs=0.05)
    assert bits == pytest.approx(shannon([950, 30, 20]), abs=1e-12)
    alert = detector.check(5.0)
    assert alert is not None
    assert (alert.at, alert.top_prefix, alert.share, alert.misses) == (5.0, b"tenant-0/", 0.95,
                                                                        1000)
    assert alert.bits == pytest.approx(shannon([950, 30, 20]), abs=1e-12)
    assert alerts == [alert]


DISTRIBUTIONS = [
    ("three even", [20, 20, 20], False),
    ("four even", [25, 25, 25, 25], False),
    ("95 % and one other", [95, 5], True),
    ("95 % and a few others", [190, 4, 3, 3], True),
    ("one prefix", [60], True),
    ("two even (1 bit)", [10, 10], True),
    ("skewed but above", [50, 20, 15, 15], False),
    ("many even", [3] * 32, False),
]


@pytest.mark.parametrize(("counts", "storm"), [row[1:] for row in DISTRIBUTIONS],
                         ids=[row[0] for row in DISTRIBUTIONS])
def test_entropy_follows_the_formula(counts: list[int], storm: bool) -> None:
    detector = MissStormDetector()
    feed(detector, prefixes(*counts), now=0.0)
    expected = shannon(counts)
    assert detector.entropy(0.0) == pytest.approx(expected, abs=1e-9)
    alert = detector.check(5.0)
    assert (alert is not None) == storm == (expected < 1.2)
    if alert is not None:
        top = max(counts)
        assert alert.bits == pytest.approx(expected, abs=1e-9)
        assert (alert.share, alert.misses) == (top / sum(counts), sum(counts))
        assert alert.top_prefix == f"tenant-{counts.index(top)}/".encode()


def test_the_threshold_is_configurable() -> None:
    detector = MissStormDetector(threshold_bits=2.5)
    feed(detector, prefixes(20, 20, 20), now=0.0)  # 1.58 bits: a storm below 2.5
    assert detector.check(5.0) is not None
    at_the_threshold = MissStormDetector(threshold_bits=1.0)
    feed(at_the_threshold, prefixes(10, 10), now=0.0)  # exactly 1 bit: not below
    assert at_the_threshold.entropy(0.0) == 1.0
    assert at_the_threshold.check(5.0) is None


def test_too_few_misses_raise_nothing() -> None:
    detector = MissStormDetector(min_misses=20)
    feed(detector, prefixes(19), now=0.0)  # 0 bits, but 19 misses
    assert detector.check(5.0) is None
    alert = detector.missed(b"tenant-0/", 10.0)
    assert alert is not None and alert.misses == 20


def test_an_empty_window_has_no_entropy_and_no_storm() -> None:
    detector = MissStormDetector(min_misses=1)
    assert detector.entropy(0.0) is None
    assert detector.check(0.0) is None
    snap = detector.snapshot(0.0)
    assert (snap.bits, snap.window_misses, snap.prefixes, snap.checks) == (None, 0, 0, 1)
    alert = detector.missed(b"x", 10.0)  # one miss is 0 bits: with min_misses 1, a storm
    assert alert is not None and alert.bits == 0.0


def test_misses_leave_the_window() -> None:
    detector = MissStormDetector()  # 60 s in slots of 1 s
    feed(detector, prefixes(100), now=0.5)
    assert detector.snapshot(59.75).window_misses == 100
    snap = detector.snapshot(60.0)  # its slot left, 59.5 s after
    assert (snap.window_misses, snap.prefixes, snap.bits, snap.misses) == (0, 0, None, 100)
    feed(detector, prefixes(20, 20, 20), now=61.0)
    assert detector.entropy(61.0) == pytest.approx(math.log2(3))


def test_old_misses_stop_weighing_on_the_entropy() -> None:
    detector = MissStormDetector()
    feed(detector, prefixes(300), now=0.0)
    feed(detector, prefixes(0, 30, 30, 30, 30), now=30.0)
    assert detector.entropy(30.0) == pytest.approx(shannon([300, 30, 30, 30, 30]))
    assert detector.entropy(60.0) == pytest.approx(2.0)  # the flood left: four even


def test_the_entropy_is_recomputed_at_most_every_interval() -> None:
    detector = MissStormDetector(interval=5.0)
    feed(detector, prefixes(20, 20, 20), now=0.0)  # the first miss checks
    assert detector.snapshot(0.0).checks == 1
    for now in (1.0, 2.0, 3.0, 4.75):
        for _ in range(100):
            assert detector.missed(b"tenant-0/", now) is None  # a flood, not looked at yet
        assert detector.check(now) is None
    snap = detector.snapshot(4.75)
    assert snap.checks == 1 and snap.bits is not None and snap.bits < 1.2
    alert = detector.missed(b"tenant-0/", 5.0)
    assert alert is not None and alert.at == 5.0
    assert detector.snapshot(5.0).checks == 2
    assert detector.check(9.75) is None
    assert detector.snapshot(9.75).checks == 2


def test_alerts_come_at_the_start_and_once_per_window_of_a_storm() -> None:
    alerts: list[MissStormAlert] = []
    detector = MissStormDetector(on_alert=alerts.append)
    for step in range(30):  # a flood that lasts 150 s; each feed's first miss runs the check
        feed(detector, prefixes(50, 1), 5.0 * step)
        assert detector.snapshot(5.0 * step).alerting == (step > 0)
    # not at 0 s (one miss in the window then), then a reminder once per window
    assert [alert.at for alert in alerts] == [5.0, 65.0, 125.0]
    assert detector.snapshot(145.0).alerts == 3


def test_a_storm_that_ends_rearms_the_detector() -> None:
    alerts: list[MissStormAlert] = []
    detector = MissStormDetector(on_alert=alerts.append)
    feed(detector, prefixes(100), now=0.0)  # the first miss checks: 1 miss, no storm yet
    assert detector.check(5.0) is not None
    assert detector.snapshot(5.0).alerting
    feed(detector, prefixes(0, 200, 200, 200, 200), now=10.0)  # spread out again
    assert detector.snapshot(10.0).alerting  # the check at 10 s saw the first of them only
    assert detector.check(15.0) is None
    assert not detector.snapshot(15.0).alerting
    feed(detector, prefixes(5000), now=16.0)  # a second storm, within a window of the first
    alert = detector.check(20.0)
    assert alert is not None and alert.top_prefix == b"tenant-0/"
    assert [a.at for a in alerts] == [5.0, 20.0]


def test_a_window_too_thin_to_judge_ends_a_storm() -> None:
    detector = MissStormDetector()
    feed(detector, prefixes(100), now=0.0)
    assert detector.check(5.0) is not None
    assert detector.check(65.0) is None  # the flood left; nothing to judge
    assert not detector.snapshot(65.0).alerting
    feed(detector, prefixes(100), now=66.0)
    assert detector.check(70.0) is not None


def test_an_alert_is_called_back_counted_and_logged_once(caplog: pytest.LogCaptureFixture,
                                                        ) -> None:
    alerts: list[MissStormAlert] = []
    detector = MissStormDetector(on_alert=alerts.append)
    with caplog.at_level(logging.WARNING, logger="tierkv.health"):
        for step in range(12):  # a 55 s storm, checked 12 times
            feed(detector, prefixes(95, 5), 5.0 * step)
    assert len(alerts) == 1 and alerts[0].at == 5.0
    assert detector.snapshot(55.0).alerts == 1
    assert [(r.name, r.levelno) for r in caplog.records] == [
        ("tierkv.health.miss_storm", logging.WARNING)]


def test_what_the_callback_raises_propagates_after_the_alert_is_recorded() -> None:
    def fail(alert: MissStormAlert) -> None:
        raise RuntimeError("callback")

    detector = MissStormDetector(min_misses=1, on_alert=fail)
    with pytest.raises(RuntimeError):
        detector.missed(b"x", 0.0)
    snap = detector.snapshot(0.0)
    assert (snap.misses, snap.window_misses, snap.alerts, snap.alerting) == (1, 1, 1, True)


def test_time_never_goes_back() -> None:
    detector = MissStormDetector()
    detector.missed(b"a", 10.5)
    detector.missed(b"b", 2.0)  # taken as 10.5
    assert detector.snapshot(69.75).window_misses == 2
    assert detector.snapshot(70.0).window_misses == 0


def test_from_config_takes_the_health_table() -> None:
    detector = MissStormDetector.from_config(HealthConfig(entropy_alert_bits=2.0, window=30.0),
                                             interval=1.0, min_misses=5)
    assert (detector.threshold_bits, detector.window, detector.interval,
            detector.min_misses) == (2.0, 30.0, 1.0, 5)
    defaults = MissStormDetector.from_config(HealthConfig())
    assert (defaults.threshold_bits, defaults.window, defaults.interval,
            defaults.min_misses) == (1.2, 60.0, 5.0, 20)


@pytest.mark.parametrize("options", [
    {"threshold_bits": -0.5}, {"threshold_bits": math.nan}, {"window": 0.0},
    {"window": math.inf}, {"interval": -1.0}, {"min_misses": 0}, {"buckets": 0},
])
def test_arguments_out_of_range_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MissStormDetector(**options)


# -- incremental counts against the formula over the naive window -------------------------------
STEPS = st.lists(st.tuples(st.sampled_from([0.0, 0.25, 1.0, 3.0, 9.0]),
                           st.sampled_from([b"a", b"b", b"c", b"d", b"e/long-prefix"])),
                 max_size=200)


@settings(max_examples=150, deadline=None)
@given(STEPS)
def test_the_window_counts_match_a_naive_recount(steps: list[tuple[float, bytes]]) -> None:
    window, buckets = 20.0, 10  # slots of 2 s
    detector = MissStormDetector(window=window, buckets=buckets, interval=3.0, min_misses=4)
    misses: list[tuple[float, bytes]] = []
    now = 0.0
    for dt, prefix in steps:
        now += dt
        alert = detector.missed(prefix, now)
        misses.append((now, prefix))
        current = math.floor(now / 2.0)
        kept = [p for t, p in misses if math.floor(t / 2.0) > current - buckets]
        counts = [kept.count(p) for p in set(kept)]
        snap = detector.snapshot(now)
        assert (snap.window_misses, snap.prefixes) == (len(kept), len(counts))
        assert snap.bits == pytest.approx(shannon(counts), abs=1e-9)
        if alert is not None:
            assert len(kept) >= 4 and alert.bits < 1.2
            assert alert.misses == len(kept)
            assert alert.share == max(counts) / len(kept)
            assert kept.count(alert.top_prefix) == max(counts)
            assert snap.alerting
