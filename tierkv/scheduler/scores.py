"""LRU++ scores: a decayed access count, discounted by the time since the last access.

``score(now) = count * exp(-beta * (now - last))``, where each access first decays the count
by alpha and then adds one (``count = alpha * count + 1``). Comparing two scores at the same
`now` compares ``log(count) + beta * last``: the order does not change while time passes, only
when a key is accessed. That invariant (`ScoreBook.rank`) is what lets each tier keep its
victims in a heap with O(log n) work per access instead of rescoring everything.

The book also keeps, per key, the tiers holding a copy. A key that leaves the cache leaves its
count behind as a *ghost* (a bounded map, oldest forgotten first), so an object that comes back
starts from its history instead of from one: without it, a block reused every few minutes looks
as new as a block never seen, and frequency stops counting for anything once the cache is small.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from tierkv._untracked import untrack

#: keys remembered after leaving the cache, per key held (4x: a simulation of the conversation
#: trace got the whole benefit of unbounded history at 4x and about half of it at 1x)
GHOSTS_PER_KEY = 4
#: ghosts kept however few keys are held
MIN_GHOSTS = 4096


@dataclass(slots=True)
class Score:
    count: float
    last: float
    #: bit i set: tier i holds a copy
    tiers: int = 0
    #: smoothed seconds between accesses (0: none seen yet), for the access frequency
    interval: float = 0.0
    #: place in its prefix chain, kept here by the scheduler from `Lineage` so that ranking a
    #: key touches one object: blocks before it, and whether its parent is in no tier
    depth: int = 0
    orphan: bool = False

    def __post_init__(self) -> None:
        untrack(self)  # atoms only: no cycle can pass through it (`tierkv._untracked`)

    def held(self) -> Iterator[int]:
        """The tiers holding a copy, fastest first."""
        held, index = self.tiers, 0
        while held:
            if held & 1:
                yield index
            held >>= 1
            index += 1


class ScoreBook:
    """Scores of the keys held in any tier (a key leaves the book with its last copy)."""

    def __init__(self, alpha: float, beta: float) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError("alpha must be in 0..1")
        if beta < 0.0:
            raise ValueError("beta must not be negative")
        self.alpha = alpha
        self.beta = beta
        self._scores: dict[bytes, Score] = {}
        self._ghosts: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._scores)

    def get(self, key: bytes) -> Score | None:
        return self._scores.get(key)

    def enter(self, key: bytes, tier: int, now: float) -> tuple[Score, bool]:
        """A copy of `key` entered `tier`: its score, and whether this is the key's first copy
        (a new object, whose insertion counts as its first access)."""
        score = self._scores.get(key)
        if score is None:
            past = self._ghosts.pop(key, None) if self._ghosts else None
            count = 1.0 if past is None else self.alpha * past + 1.0
            score = self._scores[key] = Score(count, now, 1 << tier)
            return score, True
        score.tiers |= 1 << tier
        return score, False

    def leave(self, key: bytes, tier: int) -> bool:
        """The copy of `key` in `tier` left; True when it was the last (the key leaves too)."""
        score = self._scores.get(key)
        if score is None:
            return False
        score.tiers &= ~(1 << tier)
        if score.tiers:
            return False
        del self._scores[key]
        ghosts = self._ghosts
        ghosts[key] = score.count
        # `while`: after a mass departure (an invalidated subtree) the bound falls with the
        # keys held, and one ghost forgotten per departure kept the old peak's ghosts for good
        while len(ghosts) > max(GHOSTS_PER_KEY * len(self._scores), MIN_GHOSTS):
            ghosts.popitem(last=False)
        return True

    @property
    def ghosts(self) -> int:
        return len(self._ghosts)

    def access(self, key: bytes, now: float) -> Score | None:
        score = self._scores.get(key)
        if score is not None:
            score.count = self.alpha * score.count + 1.0
            gap = max(now - score.last, 0.0)
            score.interval = gap if not score.interval else 0.8 * score.interval + 0.2 * gap
            score.last = max(score.last, now)
        return score

    def frequency(self, key: bytes, now: float) -> float:
        """Accesses per second of `key`, decayed: the smoothed rate, or less once it has been
        idle for longer than its usual interval; 0 for a key not seen twice."""
        score = self._scores.get(key)
        if score is None or not score.interval:
            return 0.0
        interval = max(score.interval, now - score.last, 1e-9)
        return 1.0 / interval

    def rank(self, score: Score) -> float:
        """Order-preserving form of the score: higher ranks are kept longer."""
        return math.log(score.count) + self.beta * score.last

    def value(self, score: Score, now: float) -> float:
        """The score itself at `now`."""
        return score.count * math.exp(-self.beta * max(now - score.last, 0.0))
