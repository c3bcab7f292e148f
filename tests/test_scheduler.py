"""The pure policy pieces: LRU order with a clock passed in, and placement down the hierarchy."""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.scheduler import LruPolicy, demotion_target, first_tier_for


def test_victim_is_least_recently_used_and_skips_protected() -> None:
    lru = LruPolicy()
    for i, key in enumerate([b"a", b"b", b"c"]):
        lru.insert(key, float(i))
    assert lru.victim(lambda key: False) == b"a"
    lru.touch(b"a", 10.0)
    assert lru.victim(lambda key: False) == b"b"
    assert lru.victim(lambda key: key == b"b") == b"c"
    assert lru.victim(lambda key: True) is None
    lru.remove(b"b")
    lru.touch(b"missing", 11.0)  # touching an absent key does not insert it
    assert b"missing" not in lru and len(lru) == 2


def test_idle_lists_keys_older_than_the_cutoff_oldest_first() -> None:
    lru = LruPolicy()
    lru.insert(b"old", 1.0)
    lru.insert(b"mid", 5.0)
    lru.insert(b"new", 9.0)
    assert lru.idle(6.0) == [b"old", b"mid"]
    lru.touch(b"old", 10.0)
    assert lru.idle(6.0) == [b"mid"]


@dataclass
class Sized:
    limit: int

    def can_ever_hold(self, nbytes: int) -> bool:
        return nbytes <= self.limit


def test_placement_walks_down_to_a_tier_that_can_hold_the_object() -> None:
    tiers = [Sized(10), Sized(100), Sized(1000)]
    assert first_tier_for(tiers, 5) == 0
    assert first_tier_for(tiers, 50) == 1
    assert first_tier_for(tiers, 5000) is None
    assert demotion_target(tiers, 0, 5) == 1
    assert demotion_target(tiers, 0, 500) == 2
    assert demotion_target(tiers, 2, 5) is None  # the last tier drops
