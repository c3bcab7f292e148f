"""The pure policy pieces: LRU order with a clock passed in, placement down the hierarchy, the
plans the scheduler makes from them, and watermarks. No devices, no clock."""

from __future__ import annotations

import pytest

from tests._shapes import Obj, Shape
from tierkv.config import EvictionPolicy, SchedulerConfig
from tierkv.scheduler import (
    Demote,
    Drop,
    Evict,
    LruPolicy,
    Promote,
    Scheduler,
    Watermarks,
    demotion_target,
    departs_from,
    first_persistent_for,
    first_tier_for,
)


def test_evict_takes_least_recently_used_first_and_skips_protected() -> None:
    lru = LruPolicy()
    for i, key in enumerate([b"a", b"b", b"c"]):
        lru.insert(key, float(i))
    assert lru.evict(1, lambda key: False) == [b"a"]
    assert lru.evict(5, lambda key: False) == [b"a", b"b", b"c"]
    lru.touch(b"a", 10.0)
    assert lru.evict(2, lambda key: False) == [b"b", b"c"]
    assert lru.evict(1, lambda key: key == b"b") == [b"c"]
    assert lru.evict(3, lambda key: True) == []
    assert lru.evict(0, lambda key: False) == []
    lru.remove(b"b")
    lru.touch(b"missing", 11.0)  # touching an absent key does not insert it
    assert b"missing" not in lru and len(lru) == 2


def test_evict_does_not_remove_its_victims() -> None:
    lru = LruPolicy()
    lru.insert(b"a", 0.0)
    assert lru.evict(1, lambda key: False) == [b"a"]
    assert b"a" in lru  # until the engine reports the copy gone


def test_idle_lists_keys_older_than_the_cutoff_oldest_first() -> None:
    lru = LruPolicy()
    lru.insert(b"old", 1.0)
    lru.insert(b"mid", 5.0)
    lru.insert(b"new", 9.0)
    assert lru.idle(6.0) == [b"old", b"mid"]
    lru.touch(b"old", 10.0)
    assert lru.idle(6.0) == [b"mid"]


def test_placement_walks_down_to_a_tier_that_can_hold_the_object() -> None:
    tiers = [Shape(10), Shape(100), Shape(1000)]
    assert first_tier_for(tiers, 5) == 0
    assert first_tier_for(tiers, 50) == 1
    assert first_tier_for(tiers, 5000) is None
    assert demotion_target(tiers, 0, 5) == 1
    assert demotion_target(tiers, 0, 500) == 2
    assert demotion_target(tiers, 2, 5) is None  # the last tier drops


def test_the_durable_tier_is_the_first_persistent_one_that_fits() -> None:
    tiers = [Shape(1000), Shape(10, persistent=True), Shape(1000, persistent=True)]
    assert first_persistent_for(tiers, 5) == 1
    assert first_persistent_for(tiers, 50) == 2
    assert first_persistent_for(tiers, 5, start=2) == 2
    assert first_persistent_for(tiers[:1], 5) is None


def hierarchy() -> list[Shape]:
    return [Shape(100), Shape(1000, persistent=True), Shape(10_000, persistent=True,
                                                          reclaims_space=True)]


def test_departures_demote_evict_or_drop_by_where_the_other_copies_are() -> None:
    scheduler = Scheduler(hierarchy(), SchedulerConfig())
    objects = {
        b"only-top": Obj(b"only-top", locations=[0]),
        b"also-below": Obj(b"also-below", locations=[0, 2]),
        b"too-big-for-middle": Obj(b"too-big-for-middle", nbytes=5000, locations=[0]),
    }
    for i, key in enumerate(objects):
        scheduler.admitted(0, key, float(i))
    plans = scheduler.departures(0, 10, lambda key: False, objects.get)
    assert plans == [
        Demote(b"only-top", 1, 10, 0, 1),
        Evict(b"also-below", 1, 10, 0),
        Demote(b"too-big-for-middle", 1, 5000, 0, 2),
    ]
    assert [departs_from(plan) for plan in plans] == [0, 0, 0]
    last = {b"x": Obj(b"x", locations=[2])}
    scheduler.admitted(2, b"x", 0.0)
    assert scheduler.departures(2, 1, lambda key: False, last.get) == [Drop(b"x", 1, 10, 2)]


def test_departures_respect_count_protection_and_a_stale_policy() -> None:
    scheduler = Scheduler(hierarchy(), SchedulerConfig())
    objects = {bytes([i]): Obj(bytes([i]), locations=[1]) for i in range(5)}
    for i, key in enumerate(objects):
        scheduler.admitted(1, key, float(i))
    scheduler.admitted(1, b"gone", 9.0)  # the index no longer has it
    plans = scheduler.departures(1, 2, lambda key: key == b"\x00", objects.get)
    assert [plan.key for plan in plans] == [b"\x01", b"\x02"]
    assert all(isinstance(plan, Demote) and plan.target == 2 for plan in plans)


def test_expired_plans_cover_only_idle_unprotected_copies() -> None:
    scheduler = Scheduler(hierarchy(), SchedulerConfig())
    objects = {b"a": Obj(b"a", locations=[0]), b"b": Obj(b"b", locations=[0]),
               b"c": Obj(b"c", locations=[0])}
    scheduler.admitted(0, b"a", 1.0)
    scheduler.admitted(0, b"b", 2.0)
    scheduler.admitted(0, b"c", 8.0)
    plans = scheduler.expired(0, 5.0, lambda key: key == b"b", objects.get)
    assert plans == [Demote(b"a", 1, 10, 0, 1, idle_since=5.0)]


def test_an_expired_plan_holds_only_while_its_object_stays_idle() -> None:
    """The engine asks `still_idle` when an expiry's plan runs, which may be much later."""
    scheduler = Scheduler(hierarchy(), SchedulerConfig())
    objects = {b"a": Obj(b"a", locations=[0])}
    scheduler.admitted(0, b"a", 1.0)
    [plan] = scheduler.expired(0, 5.0, lambda key: False, objects.get)
    assert scheduler.still_idle(plan)
    scheduler.accessed(0, b"a", 6.0)  # read after the plan was made
    assert not scheduler.still_idle(plan)
    scheduler.removed(0, b"a")
    assert not scheduler.still_idle(plan)
    assert scheduler.still_idle(Demote(b"a", 1, 10, 0, 1))  # the evictor's: no idleness asked


@pytest.mark.parametrize("policy", list(EvictionPolicy), ids=lambda p: p.value)
def test_a_read_makes_every_copy_of_the_object_recent(policy: EvictionPolicy) -> None:
    """Under `lru` a read served by the first tier touched that tier's copy only: the copy
    below aged as if never read, and expired or was evicted, taking the object with it."""
    scheduler = Scheduler(hierarchy(), SchedulerConfig(policy=policy))
    objects = {b"hot": Obj(b"hot", locations=[0, 1]), b"cold": Obj(b"cold", locations=[1])}
    for tier in (0, 1):
        scheduler.admitted(tier, b"hot", 1.0)
    scheduler.admitted(1, b"cold", 2.0)
    scheduler.accessed(0, b"hot", 8.0)  # served by the first tier
    assert [plan.key for plan in scheduler.expired(1, 5.0, lambda key: False, objects.get)] \
        == [b"cold"]
    [victim] = scheduler.departures(1, 1, lambda key: False, objects.get)
    assert victim.key == b"cold"


@pytest.mark.parametrize("enabled", [True, False])
def test_a_hit_below_earns_a_promotion_to_the_top(enabled: bool) -> None:
    scheduler = Scheduler(hierarchy(), SchedulerConfig(promote_on_hit=enabled, exclusive=True))
    below = Obj(b"k", locations=[2])
    # out of the log (which reclaims space itself) the copy stays: deleting it frees nothing
    expected = Promote(b"k", 1, 10, 2, 0, exclusive=False) if enabled else None
    assert scheduler.on_hit(below, 2) == expected
    # out of a tier the engine evicts from, the object moves (exclusive caching)
    middle = Obj(b"k", locations=[1])
    assert scheduler.on_hit(middle, 1) == (Promote(b"k", 1, 10, 1, 0, exclusive=True)
                                           if enabled else None)
    assert scheduler.on_hit(Obj(b"k", locations=[0, 2]), 2) is None  # already on top
    assert scheduler.on_hit(Obj(b"k", locations=[0]), 0) is None
    assert scheduler.on_hit(Obj(b"k", nbytes=500, locations=[1]), 1) is None  # top too small


def test_write_and_durable_tiers() -> None:
    scheduler = Scheduler(hierarchy(), SchedulerConfig())
    assert scheduler.write_tier(50) == 0
    assert scheduler.write_tier(500) == 1
    assert scheduler.write_tier(50_000) is None
    assert scheduler.next_tier(50, 0) == 1
    assert scheduler.durable_tier(50) == 1
    assert scheduler.durable_tier(5000) == 2


def test_a_barrier_writes_into_a_tier_whose_breaker_is_open_only_when_it_must() -> None:
    scheduler = Scheduler(hierarchy(), SchedulerConfig())
    scheduler.usable[1] = False
    assert scheduler.durable_tier(50) == 2 and scheduler.barrier_tier(50) == 2
    scheduler.usable[2] = False
    assert scheduler.durable_tier(50) is None
    assert scheduler.barrier_tier(50) == 1  # every persistent tier is open: the first
    assert scheduler.barrier_tier(5000) == 2
    assert scheduler.barrier_tier(50_000) is None  # none can ever hold it


def test_watermarks() -> None:
    marks = Watermarks.of(1000, 0.05, 0.1)
    assert marks == Watermarks(50, 100)
    assert Watermarks.of(16384, 0.05, 0.1) == Watermarks(820, 1639)  # rounded up
    assert marks.short(49) and not marks.short(50)
    assert marks.to_free(free=40, leaving=0, wanted=0) == 60
    assert marks.to_free(free=40, leaving=30, wanted=0) == 30
    assert marks.to_free(free=40, leaving=70, wanted=0) == 0
    assert marks.to_free(free=40, leaving=0, wanted=300) == 260  # a waiting write wants more
    assert marks.to_free(free=500, leaving=0, wanted=0) == 0
