"""The LRU++ policy pieces, pure: scores and their time-invariant rank, prefix rules (orphans
first, leaf-first), ghosts, atomic eviction batches, adaptive admission, promotion on hit, TTL
plans into free room, chain following and the entries a reclaimed log region keeps. No devices,
no clock: time is passed in."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests._shapes import Obj, Shape
from tierkv.config import Admission, EvictionPolicy, SchedulerConfig
from tierkv.keys import FLEET_CURSOR_KEY, TOMBSTONES_KEY, UNPUBLISHED_KEY
from tierkv.scheduler import Demote, Departure, Drop, Evict, Promote, Scheduler
from tierkv.scheduler.admission import AdaptiveAdmission, FrequencySketch
from tierkv.scheduler.scores import MIN_GHOSTS


def never(key: bytes) -> bool:
    return False


def three_tiers() -> list[Shape]:
    return [Shape(100), Shape(1000, persistent=True),
            Shape(10_000, persistent=True, reclaims_space=True)]


def lrupp(tiers: Sequence[Shape], **options: Any) -> Scheduler:
    return Scheduler(tiers, SchedulerConfig(policy=EvictionPolicy.LRUPP, **options))


def victims(scheduler: Scheduler, tier: int = 0,
            protected: Callable[[bytes], bool] = never) -> list[bytes]:
    """The whole eviction order of `tier` (the policy keeps its victims until removed)."""
    return scheduler.policies[tier].evict(1 << 20, protected)


def decayed_count(alpha: float, accesses: int) -> float:
    """count after `accesses` accesses of a new key: count = alpha * count + 1, from zero."""
    count = 0.0
    for _ in range(accesses):
        count = alpha * count + 1.0
    return count


# -- scores --------------------------------------------------------------------------------------
#: (alpha, beta, access times per key (the first is the insertion), expected eviction order)
SCORE_CASES = [
    pytest.param(1.0, 0.001,
                 {b"once-old": [0], b"five-old": [0, 1, 2, 3, 4], b"once-new": [50],
                  b"twice-mid": [40, 41]},
                 [b"once-old", b"once-new", b"twice-mid", b"five-old"],
                 id="small-beta-frequency-wins"),
    pytest.param(1.0, 1.0,
                 {b"ten-old": list(range(10)), b"once-new": [20], b"twice-mid": [15, 16]},
                 [b"ten-old", b"twice-mid", b"once-new"],
                 id="large-beta-recency-wins"),
    pytest.param(1.0, 0.01,
                 {b"ten-old": list(range(10)), b"three-new": [40, 41, 42], b"once": [60]},
                 [b"once", b"three-new", b"ten-old"],
                 id="alpha-1-keeps-every-access"),
    pytest.param(0.5, 0.01,
                 {b"ten-old": list(range(10)), b"three-new": [40, 41, 42], b"once": [60]},
                 [b"once", b"ten-old", b"three-new"],
                 id="alpha-half-forgets-old-accesses"),
    pytest.param(0.95, 0.0,
                 {b"a": [5], b"b": [0, 1], b"c": [0, 1, 2]},
                 [b"a", b"b", b"c"],
                 id="beta-0-pure-frequency"),
]


@pytest.mark.parametrize(("alpha", "beta", "history", "order"), SCORE_CASES)
def test_the_eviction_order_follows_the_score_and_time_does_not_change_it(
        alpha: float, beta: float, history: dict[bytes, list[int]], order: list[bytes]) -> None:
    scheduler = lrupp([Shape(1 << 30)], alpha=alpha, beta=beta)
    book = scheduler.book
    for key, times in history.items():
        scheduler.admitted(0, key, float(times[0]))
        for t in times[1:]:
            scheduler.accessed(0, key, float(t))
    assert victims(scheduler) == order
    latest = max(max(times) for times in history.values())
    for now in (latest, latest + 5.0, latest + 50.0):
        values = {}
        for key, times in history.items():
            score = book.get(key)
            assert score is not None
            expected = decayed_count(alpha, len(times)) * math.exp(-beta * (now - times[-1]))
            assert book.value(score, now) == pytest.approx(expected, rel=1e-12)
            values[key] = book.value(score, now)
        # the score at any later time orders the keys as the (time-free) rank does
        assert sorted(history, key=values.__getitem__) == order
    # time passing (a key inserted much later) does not reorder the keys already there
    scheduler.admitted(0, b"late", latest + 1000.0)
    assert [key for key in victims(scheduler) if key != b"late"] == order


def test_value_never_grows_past_the_count_for_a_time_before_the_last_access() -> None:
    scheduler = lrupp([Shape(1 << 30)], alpha=0.9, beta=0.1)
    scheduler.admitted(0, b"k", 10.0)
    score = scheduler.book.get(b"k")
    assert score is not None
    assert scheduler.book.value(score, 5.0) == pytest.approx(1.0)  # idle time is never negative
    assert scheduler.book.value(score, 20.0) == pytest.approx(math.exp(-1.0))


def test_an_access_never_moves_the_last_access_back_in_time() -> None:
    scheduler = lrupp([Shape(1 << 30)], alpha=1.0, beta=0.1)
    scheduler.admitted(0, b"k", 10.0)
    scheduler.accessed(0, b"k", 3.0)  # a late report of an earlier read
    score = scheduler.book.get(b"k")
    assert score is not None and score.last == 10.0 and score.count == 2.0


# -- prefix rules ----------------------------------------------------------------------------
def test_an_orphan_goes_first_and_is_ranked_normally_once_its_parent_returns() -> None:
    scheduler = lrupp([Shape(1 << 30), Shape(1 << 30)], alpha=1.0, beta=0.01)
    scheduler.admitted(0, b"parent", 0.0)
    scheduler.admitted(0, b"child", 0.0, parents=[b"parent"])
    for t in range(1, 20):
        scheduler.accessed(0, b"child", float(t))  # the child ranks far above `plain`
    scheduler.admitted(0, b"plain", 1.0)
    assert victims(scheduler) == [b"parent", b"plain", b"child"]

    scheduler.removed(0, b"parent")  # its last copy left: no prefix lookup reaches the child
    assert victims(scheduler) == [b"child", b"plain"]

    scheduler.admitted(1, b"parent", 30.0)  # back, in another tier: the child is adopted again
    assert victims(scheduler) == [b"plain", b"child"]
    assert victims(scheduler, 1) == [b"parent"]


def test_a_child_whose_parent_is_only_in_another_tier_is_not_an_orphan() -> None:
    scheduler = lrupp([Shape(1 << 30), Shape(1 << 30)], alpha=1.0, beta=0.01)
    scheduler.admitted(1, b"parent", 0.0)
    scheduler.admitted(0, b"child", 5.0, parents=[b"parent"])
    scheduler.admitted(0, b"older", 1.0)
    assert victims(scheduler) == [b"older", b"child"]


def test_a_chain_accessed_together_leaves_leaf_first() -> None:
    scheduler = lrupp([Shape(1 << 30)])
    scheduler.admitted(0, b"a", 0.0)
    scheduler.admitted(0, b"b", 0.0, parents=[b"a"])
    scheduler.admitted(0, b"c", 0.0, parents=[b"b"])
    assert victims(scheduler) == [b"c", b"b", b"a"]
    for key in (b"a", b"b", b"c"):  # a prefix read of the whole chain at one time
        scheduler.accessed(0, key, 7.0)
    assert victims(scheduler) == [b"c", b"b", b"a"]
    scheduler.removed(0, b"c")
    assert victims(scheduler) == [b"b", b"a"]


# -- ghosts ----------------------------------------------------------------------------------
def test_a_key_that_comes_back_starts_from_its_decayed_count() -> None:
    alpha = 0.9
    scheduler = lrupp([Shape(1 << 30)], alpha=alpha, beta=0.01)
    scheduler.admitted(0, b"regular", 0.0)
    for t in range(1, 6):
        scheduler.accessed(0, b"regular", float(t))
    scheduler.removed(0, b"regular")
    assert scheduler.book.get(b"regular") is None
    assert scheduler.book.ghosts == 1

    scheduler.admitted(0, b"new", 100.0)
    scheduler.admitted(0, b"regular", 100.0)  # the same time: only history tells them apart
    score = scheduler.book.get(b"regular")
    assert score is not None
    assert score.count == pytest.approx(alpha * decayed_count(alpha, 6) + 1.0)
    assert victims(scheduler) == [b"new", b"regular"]
    assert scheduler.book.ghosts == 0  # the ghost became the key again


def test_ghosts_are_bounded_and_the_oldest_is_forgotten_first() -> None:
    scheduler = lrupp([Shape(1 << 30)], alpha=1.0, beta=0.0)
    book = scheduler.book
    total = MIN_GHOSTS + 100
    for i in range(total):
        key = b"k%d" % i
        scheduler.admitted(0, key, float(i))
        scheduler.accessed(0, key, float(i))
        scheduler.removed(0, key)
    assert book.ghosts == MIN_GHOSTS and len(book) == 0
    scheduler.admitted(0, b"k0", 1e6)  # forgotten: as new as a key never seen
    scheduler.admitted(0, b"k%d" % (total - 1), 1e6)  # remembered: count 2 (alpha 1), plus 1
    first, last = book.get(b"k0"), book.get(b"k%d" % (total - 1))
    assert first is not None and first.count == 1.0
    assert last is not None and last.count == 3.0


def test_ghosts_follow_the_keys_held_down_after_a_mass_departure() -> None:
    """Ghosts are bounded by the keys held now (GHOSTS_PER_KEY each), not by a past peak."""
    scheduler = lrupp([Shape(1 << 30)], alpha=1.0, beta=0.0)
    book = scheduler.book
    held = 4 * MIN_GHOSTS
    for i in range(held):
        scheduler.admitted(0, b"k%d" % i, float(i))
    for i in range(held // 2):  # a big subtree invalidated: half the keys leave
        scheduler.removed(0, b"k%d" % i)
    assert book.ghosts == held // 2  # under GHOSTS_PER_KEY x the half still held
    for i in range(held // 2, held):  # and then the rest
        scheduler.removed(0, b"k%d" % i)
    assert len(book) == 0 and book.ghosts == MIN_GHOSTS


def test_a_key_leaves_the_book_only_with_its_last_copy() -> None:
    scheduler = lrupp(three_tiers(), alpha=1.0, beta=0.0)
    book = scheduler.book
    scheduler.admitted(0, b"k", 0.0)
    scheduler.admitted(2, b"k", 0.0)  # a second copy is not a new object: no extra access
    score = book.get(b"k")
    assert score is not None and score.count == 1.0
    scheduler.removed(0, b"k")
    assert book.get(b"k") is score and book.ghosts == 0
    assert b"k" not in scheduler.policies[0] and b"k" in scheduler.policies[2]
    scheduler.removed(2, b"k")
    assert book.get(b"k") is None and book.ghosts == 1
    scheduler.removed(1, b"absent")  # no effect
    assert book.ghosts == 1 and len(book) == 0


# -- eviction batches ------------------------------------------------------------------------
def expected_departure(tiers: Sequence[Shape], tier: int, obj: Obj) -> Departure:
    if any(location > tier for location in obj.locations):
        return Evict(obj.key, obj.generation, obj.nbytes, tier)
    target = next((t for t in range(tier + 1, len(tiers)) if tiers[t].can_ever_hold(obj.nbytes)),
                  None)
    if target is None:
        return Drop(obj.key, obj.generation, obj.nbytes, tier)
    return Demote(obj.key, obj.generation, obj.nbytes, tier, target)


@pytest.mark.parametrize("seed", range(5))
def test_eviction_batches_are_bounded_unprotected_distinct_and_fit_the_copies(seed: int) -> None:
    rng = random.Random(seed)
    # the middle tier holds objects the last one cannot: a Drop from it is the only way out
    tiers = [Shape(100), Shape(1000, persistent=True), Shape(200, persistent=True)]
    scheduler = lrupp(tiers)
    objects: dict[bytes, Obj] = {}
    for i in range(120):
        key = b"k%03d" % i
        nbytes = rng.choice([10, 80, 150, 600])
        homes = [t for t in range(3) if tiers[t].can_ever_hold(nbytes)]
        locations = sorted(rng.sample(homes, rng.randint(1, len(homes))))
        objects[key] = obj = Obj(key, nbytes, locations, generation=i + 1)
        for location in obj.locations:
            scheduler.admitted(location, key, rng.uniform(0, 100))
        for _ in range(rng.randrange(3)):
            scheduler.accessed(obj.locations[0], key, rng.uniform(0, 100))
    pinned = {key for key in objects if rng.random() < 0.2}

    for tier in range(3):
        held = {key for key, obj in objects.items() if tier in obj.locations}
        planned: set[bytes] = set()
        blocked = set(pinned)  # pinned, or planned already (the engine marks them moving)
        while True:
            plans = scheduler.departures(tier, 16, blocked.__contains__, objects.get)
            if not plans:
                break
            assert len(plans) <= 16
            keys = [plan.key for plan in plans]
            assert len(set(keys)) == len(keys), "a key planned twice in one batch"
            assert not set(keys) & planned, "a key planned again while its plan is under way"
            assert not set(keys) & pinned
            for plan in plans:
                assert plan == expected_departure(tiers, tier, objects[plan.key])
            planned.update(keys)
            blocked.update(keys)
        assert planned == held - pinned  # every unprotected copy is planned exactly once


def test_a_batch_takes_the_best_victims_first_and_repeats_until_they_leave() -> None:
    scheduler = lrupp(three_tiers(), alpha=1.0, beta=0.01)
    objects = {b"k%d" % i: Obj(b"k%d" % i, locations=[0]) for i in range(40)}
    for i, key in enumerate(objects):
        scheduler.admitted(0, key, float(i))
    first = scheduler.departures(0, 16, never, objects.get)
    assert [plan.key for plan in first] == [b"k%d" % i for i in range(16)]
    # nothing left yet: the same victims again (the caller protects what it has started)
    assert scheduler.departures(0, 16, never, objects.get) == first
    for plan in first:
        scheduler.removed(0, plan.key)
    assert [plan.key for plan in scheduler.departures(0, 4, never, objects.get)] == [
        b"k16", b"k17", b"k18", b"k19"]
    assert scheduler.departures(0, 0, never, objects.get) == []


def test_keys_protected_during_an_eviction_come_back_in_their_place_once_free() -> None:
    scheduler = lrupp(three_tiers(), alpha=1.0, beta=0.01)
    policy = scheduler.policies[0]
    keys = [b"k%d" % i for i in range(12)]
    for i, key in enumerate(keys):
        scheduler.admitted(0, key, float(i))
    busy = set(keys[:4])  # moving, pinned or written while the evictor asks
    assert policy.evict(4, busy.__contains__) == keys[4:8]
    assert policy.evict(4, busy.__contains__) == keys[4:8]  # victims stay until removed
    for key in keys[4:8]:
        scheduler.removed(0, key)
    busy -= {keys[0], keys[2]}
    busy.add(keys[8])
    # the freed keys are the oldest again; a removed one never returns
    assert policy.evict(4, busy.__contains__) == [keys[0], keys[2], keys[9], keys[10]]
    scheduler.accessed(0, keys[1], 100.0)  # read while protected: re-ranked, youngest now
    scheduler.removed(0, keys[3])
    assert victims(scheduler) == [keys[0], keys[2], keys[8], keys[9], keys[10], keys[11],
                                  keys[1]]


def test_an_orphan_is_dropped_rather_than_demoted() -> None:
    scheduler = lrupp(three_tiers())
    objects = {b"orphan": Obj(b"orphan", locations=[0]), b"plain": Obj(b"plain", locations=[0])}
    scheduler.admitted(0, b"orphan", 5.0, parents=[b"never-cached"])
    scheduler.admitted(0, b"plain", 1.0)
    assert scheduler.departures(0, 16, never, objects.get) == [
        Drop(b"orphan", 1, 10, 0), Demote(b"plain", 1, 10, 0, 1)]


# -- admission -------------------------------------------------------------------------------
def feed_epoch(admission: AdaptiveAdmission, ratio: float, epoch: int) -> None:
    hits = round(ratio * epoch)
    for i in range(epoch):
        admission.looked_up(b"seen%d" % i, i < hits)


def test_the_admission_threshold_climbs_while_each_step_helps() -> None:
    admission = AdaptiveAdmission(64, epoch=10, max_threshold=3)
    assert admission.threshold == 0  # it starts admitting everything
    thresholds = []
    for ratio in (0.1, 0.2, 0.3, 0.4, 0.5):
        feed_epoch(admission, ratio, 10)
        thresholds.append(admission.threshold)
    # one step up per epoch while each step helped; at the maximum the climb turns round
    assert thresholds == [1, 2, 3, 2, 1]
    for _ in range(9):  # an epoch not yet complete changes nothing
        admission.looked_up(b"seen0", True)
    assert admission.threshold == 1


def test_a_step_that_hurts_is_undone_and_tried_again_ever_later() -> None:
    admission = AdaptiveAdmission(64, epoch=10, max_threshold=3)
    feed_epoch(admission, 0.5, 10)  # judged at 0: step up to 1
    assert admission.threshold == 1
    trials = []
    for _ in range(40):  # filtering always costs: every epoch at threshold 1 is worse
        feed_epoch(admission, 0.3 if admission.threshold else 0.5, 10)
        trials.append(admission.threshold)
    # undone at once each time; the rests between tries double (1, 2, 4, 8, ...)
    assert trials[0] == 0
    starts = [n for n, t in enumerate(trials) if t == 1]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]
    assert sum(trials) <= 8  # most epochs spent admitting everything


def test_at_threshold_0_everything_is_admitted() -> None:
    admission = AdaptiveAdmission(64, epoch=10)
    assert admission.admit(b"never-looked-up")  # threshold 0: even an unseen key
    feed_epoch(admission, 0.5, 10)  # threshold 1 now: an unseen key is refused
    assert not admission.admit(b"cold-unseen")
    assert admission.admit(b"seen3")
    assert admission.admitted == 2 and admission.rejected == 1


def test_a_key_looked_up_often_enough_is_admitted() -> None:
    admission = AdaptiveAdmission(64, epoch=10)
    feed_epoch(admission, 0.5, 10)  # threshold 1
    admission.looked_up(b"hot", False)
    assert admission.admit(b"hot") and not admission.admit(b"cold")


def test_without_adaptation_the_threshold_stays_0_and_all_is_admitted() -> None:
    admission = AdaptiveAdmission(64, adaptive=False, epoch=10)
    for ratio in (0.1, 0.9, 0.1, 0.9, 0.5):
        feed_epoch(admission, ratio, 10)
        assert admission.threshold == 0
    assert admission.sketch.estimate(b"seen0") == 0  # not even counted
    assert all(admission.admit(b"cold%d" % i) for i in range(50))
    assert admission.rejected == 0


def test_the_sketch_counts_at_least_each_addition_up_to_15() -> None:
    sketch = FrequencySketch(1 << 16, sample=1 << 20)
    for n in range(1, 21):
        sketch.add(b"key")
        assert min(n, 15) <= sketch.estimate(b"key") <= 15
    assert sketch.estimate(b"other") == 0


def test_the_sketch_halves_every_count_after_sample_additions() -> None:
    sketch = FrequencySketch(1 << 16, sample=100)
    for _ in range(10):
        sketch.add(b"hot")
    for i in range(89):
        sketch.add(b"filler%d" % i)
    assert sketch.estimate(b"hot") == 10  # 99 additions
    sketch.add(b"filler-last")  # the 100th
    assert sketch.estimate(b"hot") == 5


def test_demotions_into_a_persistent_tier_pass_the_admission_filter() -> None:
    scheduler = lrupp(three_tiers(), admission=Admission.ADAPTIVE)
    for admission in scheduler.admission.values():
        admission.threshold = 1  # as after a climb that helped
    objects = {b"hot": Obj(b"hot", locations=[0]), b"cold": Obj(b"cold", locations=[0])}
    scheduler.admitted(0, b"hot", 1.0)
    scheduler.admitted(0, b"cold", 0.0)
    scheduler.looked_up(b"hot", True)
    plans = scheduler.departures(0, 16, never, objects.get)
    # cold is refused by both persistent tiers (threshold 1, never looked up): it leaves
    assert plans == [Drop(b"cold", 1, 10, 0), Demote(b"hot", 1, 10, 0, 1)]


# -- promotion on hit ------------------------------------------------------------------------
def test_a_hit_below_is_promoted_when_the_top_tier_has_room_or_it_outranks_the_top() -> None:
    tiers = [Shape(50), Shape(1000, persistent=True)]
    scheduler = lrupp(tiers, alpha=1.0, beta=0.01, exclusive=True)
    for i in range(5):
        scheduler.admitted(0, b"top%d" % i, 100.0)
    scheduler.admitted(1, b"cold", 0.0)
    scheduler.admitted(1, b"hot", 0.0)
    for t in range(200, 210):
        scheduler.accessed(1, b"hot", float(t))
    cold, hot = Obj(b"cold", locations=[1]), Obj(b"hot", locations=[1])

    tiers[0].used = 0  # room on top: any hit below earns a copy
    assert scheduler.on_hit(cold, 1) == Promote(b"cold", 1, 10, 1, 0, exclusive=True)

    tiers[0].used = 50  # full: only a key outranking the top's next victim earns one
    assert scheduler.on_hit(cold, 1) is None
    assert scheduler.on_hit(hot, 1) == Promote(b"hot", 1, 10, 1, 0, exclusive=True)

    scheduler.admitted(0, b"orphan", 300.0, parents=[b"never-cached"])
    assert scheduler.on_hit(cold, 1) == Promote(b"cold", 1, 10, 1, 0, exclusive=True)


def test_a_hit_is_promoted_only_when_its_next_read_is_due_within_the_top_tiers_ttl() -> None:
    """A copy the first tier's TTL would move out before the object's next read is a write for
    nothing that holds the room of another object meanwhile."""
    tiers = [Shape(50), Shape(1000, persistent=True)]
    scheduler = Scheduler(tiers, SchedulerConfig(policy=EvictionPolicy.LRUPP),
                          ttls=[5.0, None])
    scheduler.admitted(1, b"often", 0.0)
    scheduler.admitted(1, b"seldom", 0.0)
    for t in (2.0, 4.0, 6.0):
        scheduler.accessed(1, b"often", t)  # read every 2 s
    scheduler.accessed(1, b"seldom", 60.0)  # read a minute after it came
    assert scheduler.on_hit(Obj(b"often", locations=[1]), 1) == Promote(
        b"often", 1, 10, 1, 0, exclusive=False)
    assert scheduler.on_hit(Obj(b"seldom", locations=[1]), 1) is None

    no_ttl = Scheduler(tiers, SchedulerConfig(policy=EvictionPolicy.LRUPP), ttls=[None, None])
    no_ttl.admitted(1, b"seldom", 0.0)
    no_ttl.accessed(1, b"seldom", 60.0)  # room on top and no TTL: it stays until read again
    assert no_ttl.on_hit(Obj(b"seldom", locations=[1]), 1) == Promote(
        b"seldom", 1, 10, 1, 0, exclusive=False)


def test_into_a_full_top_a_hit_is_promoted_only_if_read_again_before_its_rank_is_reached() -> None:
    """Ranks of what a full tier lets go rise by beta a second, so a copy ranked d above the
    next victim stays about d / beta seconds: a promotion needs the next read due sooner."""
    beta = 0.01
    tiers = [Shape(50, used=50), Shape(1000, persistent=True)]
    scheduler = lrupp(tiers, alpha=1.0, beta=beta)
    scheduler.admitted(0, b"victim", 100.0)  # rank log(1) + 100 beta
    for key, gap in ((b"due", 20.0), (b"late", 100.0)):
        scheduler.admitted(1, key, 110.0 - gap)
        scheduler.accessed(1, key, 110.0)  # both: rank log(2) + 110 beta, interval `gap`
    stay = (math.log(2.0) + 110 * beta - 100 * beta) / beta  # about 79 s
    assert 20.0 < stay < 100.0
    assert scheduler.on_hit(Obj(b"due", locations=[1]), 1) == Promote(
        b"due", 1, 10, 1, 0, exclusive=False)
    assert scheduler.on_hit(Obj(b"late", locations=[1]), 1) is None  # outranks it all the same


def test_a_chain_is_not_warmed_when_it_is_read_less_often_than_the_top_tier_keeps_blocks() -> None:
    tiers = [Shape(1000), Shape(1000, persistent=True)]
    scheduler = Scheduler(tiers, SchedulerConfig(policy=EvictionPolicy.LRUPP),
                          ttls=[5.0, None])
    scheduler.admitted(0, b"root", 0.0)
    scheduler.admitted(1, b"next", 0.0, parents=[b"root"])
    scheduler.accessed(0, b"root", 2.0)  # the chain is read every 2 s: its blocks are warmed
    assert scheduler.following(b"root", 4, 10) == [b"next"]
    scheduler.accessed(0, b"root", 302.0)  # now every minute or so (interval 61.6 s)
    assert scheduler.following(b"root", 4, 10) == []


def test_the_lru_baseline_promotes_every_hit_below_even_into_a_full_top() -> None:
    tiers = [Shape(50, used=50), Shape(1000, persistent=True)]
    scheduler = Scheduler(tiers, SchedulerConfig(policy=EvictionPolicy.LRU, exclusive=True))
    scheduler.admitted(0, b"top", 100.0)
    scheduler.admitted(1, b"cold", 0.0)
    assert scheduler.on_hit(Obj(b"cold", locations=[1]), 1) == Promote(
        b"cold", 1, 10, 1, 0, exclusive=True)
    assert scheduler.following(b"cold", 4, 10) == []  # no chains without lru++


def test_inclusive_promotions_keep_the_lower_copy() -> None:
    """Inclusive is the default: a read never moves a flushed object off persistent media."""
    tiers = [Shape(50), Shape(1000, persistent=True)]
    scheduler = lrupp(tiers)
    scheduler.admitted(1, b"k", 0.0)
    plan = scheduler.on_hit(Obj(b"k", locations=[1]), 1)
    assert plan == Promote(b"k", 1, 10, 1, 0, exclusive=False)
    write_through = Scheduler(tiers, SchedulerConfig(), keep_lower_copies=True)
    write_through.admitted(1, b"k", 0.0)
    promote = write_through.on_hit(Obj(b"k", locations=[1]), 1)
    assert promote is not None and not promote.exclusive


def test_a_promotion_out_of_a_tier_that_reclaims_space_always_copies() -> None:
    """Deleting in the nvme log frees nothing until its region is reclaimed: the copy stays."""
    scheduler = lrupp(three_tiers(), exclusive=True)
    scheduler.admitted(2, b"k", 0.0)
    below = Obj(b"k", locations=[2])
    assert scheduler.on_hit(below, 2) == Promote(b"k", 1, 10, 2, 0, exclusive=False)
    assert scheduler.warm(below) == Promote(b"k", 1, 10, 2, 0, exclusive=False)
    scheduler.admitted(1, b"m", 0.0)
    assert scheduler.warm(Obj(b"m", locations=[1])) == Promote(b"m", 1, 10, 1, 0,
                                                               exclusive=True)
    assert scheduler.warm(Obj(b"m", locations=[0, 1])) is None  # already on top
    assert scheduler.warm(Obj(b"m", nbytes=500, locations=[1])) is None  # top too small


# -- what a reclaimed log region keeps ---------------------------------------------------------
def log_worth(scheduler: Scheduler, key: bytes) -> float:
    """What `key`'s entry in the log (tier 2) is worth to a reclaim, as LRU++ judges it."""
    worth = scheduler.reclaim_worth(2, key, held=(2,))
    assert worth is not None  # LRU++ always judges
    return worth


def test_a_reclaimed_log_entry_is_kept_by_durability_then_by_rank() -> None:
    """The nvme log (tier 2) asks, for each live entry of a region it reclaims, whether to copy
    it forward; the bar for an entry held nowhere else is the last admission's rank."""
    scheduler = lrupp(three_tiers())
    scheduler.admitted(2, b"old", 0.0)
    scheduler.admitted(2, b"read", 0.0)
    scheduler.admitted(2, b"up", 1.0)
    scheduler.admitted(0, b"up", 2.0)  # promoted: the log holds its only persistent copy
    scheduler.admitted(2, b"both", 1.0)
    scheduler.admitted(1, b"both", 2.0)  # also in the pmem pool, which serves it first
    scheduler.admitted(2, b"orphan", 10.0, parents=[b"never-stored"])
    scheduler.admitted(2, b"peer", 10.0)
    scheduler.admitted(2, b"new", 10.0)  # the bar: count 1, last access at 10
    scheduler.accessed(2, b"read", 20.0)
    keeps = {key: log_worth(scheduler, key) > 0
             for key in (b"old", b"read", b"up", b"both", b"orphan", b"peer", b"unknown")}
    assert keeps == {b"old": False, b"read": True, b"up": True, b"both": False,
                     b"orphan": False, b"peer": False, b"unknown": False}  # a tie: dropped
    assert log_worth(scheduler, b"up") == math.inf  # before any other: durability
    assert 0 < log_worth(scheduler, b"read") < math.inf
    scheduler.admitted(2, b"newer", 200.0)
    assert log_worth(scheduler, b"read") == 0  # the bar rose past it
    assert log_worth(scheduler, b"up") == math.inf  # durability does not depend on rank
    scheduler.removed(0, b"up")
    assert log_worth(scheduler, b"up") == 0  # back to the rank: below the bar now

    lru = Scheduler(three_tiers(), SchedulerConfig(policy=EvictionPolicy.LRU))
    lru.admitted(2, b"old", 0.0)
    assert lru.reclaim_worth(2, b"old", held=(2,)) is None  # no ranking: the tier's own rule stays
    assert lru.reclaim_worth(2, b"old", held=(2, 1)) is None  # pmem holds it too
    # the last lasting copy of an object the gpu tier still serves: a flush's, kept at any price
    assert lru.reclaim_worth(2, b"old", held=(0, 2)) == math.inf


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_the_engines_own_records_always_stay_in_a_reclaimed_log_region(
        policy: EvictionPolicy) -> None:
    """The records of refused deletes, the fleet cursor: dropped by a reclaim, a flush that
    recorded a delete would be undone, and after a crash the deleted value would come back."""
    scheduler = Scheduler(three_tiers(), SchedulerConfig(policy=policy))
    for key in (TOMBSTONES_KEY, FLEET_CURSOR_KEY, UNPUBLISHED_KEY):
        assert scheduler.reclaim_worth(2, key, held=()) == math.inf


# -- expiry ----------------------------------------------------------------------------------
def expiry_setup() -> tuple[Scheduler, dict[bytes, Obj]]:
    scheduler = lrupp(three_tiers())
    objects = {b"a": Obj(b"a", locations=[0]), b"b": Obj(b"b", locations=[0]),
               b"c": Obj(b"c", locations=[0, 2]), b"fresh": Obj(b"fresh", locations=[0])}
    scheduler.admitted(0, b"a", 1.0)
    scheduler.admitted(0, b"b", 2.0)
    scheduler.admitted(0, b"c", 3.0)
    scheduler.admitted(2, b"c", 3.0)
    scheduler.admitted(0, b"fresh", 20.0)
    return scheduler, objects


def test_expiry_without_a_room_report_plans_every_idle_copy() -> None:
    scheduler, objects = expiry_setup()
    assert scheduler.expired(0, 10.0, never, objects.get) == [
        Demote(b"a", 1, 10, 0, 1, 10.0), Demote(b"b", 1, 10, 0, 1, 10.0),
        Evict(b"c", 1, 10, 0, 10.0)]


@pytest.mark.parametrize(("room", "expected"), [
    ({1: 0, 2: 0}, [b"c"]),
    ({1: 15, 2: 0}, [b"a", b"c"]),  # b does not fit in what a left
    ({1: 20, 2: 0}, [b"a", b"b", b"c"]),
    ({1: 0, 2: 10_000}, [b"c"]),  # the target is the next tier: room further down is not used
])
def test_expiry_demotes_only_into_free_room_and_evicts_regardless(
        room: dict[int, int], expected: list[bytes]) -> None:
    scheduler, objects = expiry_setup()
    plans = scheduler.expired(0, 10.0, never, objects.get, room.__getitem__)
    assert [plan.key for plan in plans] == expected
    for plan in plans:
        if isinstance(plan, Demote):
            assert plan.target == 1
        else:
            assert isinstance(plan, Evict)
    demoted = sum(plan.nbytes for plan in plans if isinstance(plan, Demote))
    assert demoted <= room[1]


def test_expiry_skips_protected_and_fresh_copies() -> None:
    scheduler, objects = expiry_setup()
    plans = scheduler.expired(0, 10.0, lambda key: key in (b"a", b"c"), objects.get,
                              lambda tier: 1000)
    assert plans == [Demote(b"b", 1, 10, 0, 1, 10.0)]
    assert scheduler.still_idle(plans[0])
    scheduler.accessed(0, b"b", 15.0)
    assert not scheduler.still_idle(plans[0])  # a plan made before the read no longer holds
    assert scheduler.expired(0, 10.0, never, objects.get, lambda tier: 1000) == [
        Demote(b"a", 1, 10, 0, 1, 10.0), Evict(b"c", 1, 10, 0, 10.0)]


def test_expiry_in_the_last_tier_drops_the_idle_copies() -> None:
    scheduler = lrupp(three_tiers())
    objects = {b"old": Obj(b"old", locations=[2]), b"new": Obj(b"new", locations=[2])}
    scheduler.admitted(2, b"old", 1.0)
    scheduler.admitted(2, b"new", 20.0)
    assert scheduler.expired(2, 10.0, never, objects.get, lambda tier: 0) == [
        Drop(b"old", 1, 10, 2, 10.0)]


# -- chains ----------------------------------------------------------------------------------
def test_following_walks_the_best_ranked_child_chain_up_to_depth() -> None:
    scheduler = lrupp([Shape(1 << 30), Shape(1 << 30)], alpha=1.0, beta=0.01)
    scheduler.admitted(0, b"root", 0.0)
    scheduler.admitted(0, b"x", 1.0, parents=[b"root"])
    scheduler.admitted(1, b"y", 1.0, parents=[b"root"])  # in a lower tier: still followed
    scheduler.accessed(1, b"y", 2.0)
    scheduler.admitted(0, b"y1", 1.0, parents=[b"y"])
    scheduler.admitted(0, b"y2", 3.0, parents=[b"y"])
    scheduler.admitted(0, b"y3", 3.0, parents=[b"y2"])
    scheduler.admitted(0, b"y4", 3.0, parents=[b"y3"])
    assert scheduler.following(b"root", 2, 10) == [b"y", b"y2"]
    assert scheduler.following(b"root", 10, 10) == [b"y", b"y2", b"y3", b"y4"]
    assert scheduler.following(b"root", 0, 10) == []
    assert scheduler.following(b"y4", 4, 10) == []
    assert scheduler.following(b"unknown", 4, 10) == []
    scheduler.accessed(0, b"x", 50.0)  # x now outranks y
    assert scheduler.following(b"root", 3, 10) == [b"x"]
    scheduler.removed(0, b"x")  # a child that left is no longer followed
    assert scheduler.following(b"root", 2, 10) == [b"y", b"y2"]


# -- bookkeeping -----------------------------------------------------------------------------
def test_the_order_stays_exact_through_many_reranks_and_removals() -> None:
    """Thousands of accesses re-rank a few keys many times over (stale heap items pile up and
    are compacted): the order is still the model's, and removed keys never come back."""
    alpha, beta = 0.9, 0.01
    scheduler = lrupp([Shape(1 << 30)], alpha=alpha, beta=beta)
    rng = random.Random(7)
    model: dict[bytes, tuple[float, float]] = {}
    now = 0.0
    for i in range(64):
        key = b"k%02d" % i
        scheduler.admitted(0, key, now)
        model[key] = (1.0, now)
    for step in range(6000):
        now += rng.random()
        key = rng.choice(sorted(model))
        if step % 500 == 499:
            scheduler.removed(0, key)
            del model[key]
            continue
        count, _ = model[key]
        scheduler.accessed(0, key, now)
        model[key] = (alpha * count + 1.0, now)
        if step % 1000 == 0:
            scheduler.accessed(0, b"never-admitted", now)  # no effect
    expected = sorted(model, key=lambda k: math.log(model[k][0]) + beta * model[k][1])
    assert victims(scheduler) == expected
    assert len(scheduler.policies[0]) == len(model) == 64 - 12
    assert b"never-admitted" not in scheduler.policies[0]
    cutoff = now - 50.0
    assert scheduler.policies[0].idle(cutoff) == sorted(
        (k for k in model if model[k][1] < cutoff), key=lambda k: model[k][1])
