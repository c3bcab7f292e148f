"""LRU++ order of the objects in one tier: lowest standing first, in a heap.

An `EvictionPolicy` (`tierkv.scheduler.policy`). A key's standing is the tuple
``(not orphaned, rank, -depth)``: orphans (blocks whose parent no tier holds) go first, then the
lowest LRU++ rank (`ScoreBook.rank`, which time does not reorder), and among equal ranks the
deepest block of a chain before its ancestors (leaf-first). Every change of a key's standing
pushes a new heap item stamped with a fresh sequence number; older items of the key are stale
and skipped when they surface, and the heap is rebuilt once stale items outnumber live ones,
so each access costs O(log n) and `evict` costs the victims it returns plus what it skips.
Idle keys (for TTLs) come from a second, recency-ordered map.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from tierkv.scheduler.scores import Score, ScoreBook

#: (standing class, rank, -depth, sequence, key); sequence breaks ties oldest first
_Item = tuple[int, float, int, int, bytes]


class ScoredPolicy:
    def __init__(self, book: ScoreBook, *, track_idle: bool = True) -> None:
        self._book = book
        #: keep the recency order `idle` needs (only tiers with a TTL ask for it)
        self._track_idle = track_idle
        self._heap: list[_Item] = []
        self._current: dict[bytes, int] = {}  # key -> sequence of its live heap item
        self._recent: OrderedDict[bytes, float] = OrderedDict()
        self._sequence = 0

    def __len__(self) -> int:
        return len(self._current)

    def __contains__(self, key: bytes) -> bool:
        return key in self._current

    def insert(self, key: bytes, now: float) -> None:
        self.insert_scored(key, self._book.get(key), now)

    def touch(self, key: bytes, now: float) -> None:
        if key in self._current:
            self.insert_scored(key, self._book.get(key), now)

    def insert_scored(self, key: bytes, score: Score | None, now: float) -> None:
        """`insert` of a key whose score the caller holds (one lookup fewer on the hot path)."""
        if self._track_idle:
            self._recent[key] = now
            self._recent.move_to_end(key)
        self._push(key, score)

    def touch_scored(self, key: bytes, score: Score, now: float) -> None:
        """`touch` of a key whose score the caller holds."""
        if key in self._current:
            self.insert_scored(key, score, now)

    def rerank(self, key: bytes) -> None:
        """`key`'s standing changed without an access (its parent came or went)."""
        if key in self._current:
            self._push(key, self._book.get(key))

    def remove(self, key: bytes) -> None:
        if self._current.pop(key, None) is not None and self._track_idle:
            self._recent.pop(key, None)

    def standing(self, key: bytes) -> tuple[int, float, int]:
        return self._standing(self._book.get(key))

    def _standing(self, score: Score | None) -> tuple[int, float, int]:
        if score is None:
            return (0, float("-inf"), 0)
        return (0 if score.orphan else 1, self._book.rank(score), -score.depth)

    def lowest(self) -> tuple[int, float, int] | None:
        """The standing of the next victim, or ``None`` for an empty tier."""
        heap = self._heap
        while heap:
            item = heap[0]
            if self._current.get(item[4]) == item[3]:
                return item[0], item[1], item[2]
            heapq.heappop(heap)
        return None

    def evict(self, count: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        victims: list[bytes] = []
        skipped: list[_Item] = []
        heap, current = self._heap, self._current
        while heap and len(victims) < count:
            item = heapq.heappop(heap)
            key = item[4]
            if current.get(key) != item[3]:
                continue  # stale: the key was re-ranked or removed since
            if not protected(key):
                victims.append(key)
            skipped.append(item)  # a victim's item stays too: the key leaves when `remove`d
        for item in skipped:
            heapq.heappush(heap, item)
        return victims

    def idle(self, cutoff: float) -> list[bytes]:
        stale: list[bytes] = []
        for key, last in self._recent.items():
            if last >= cutoff:
                break
            stale.append(key)
        return stale

    def idle_since(self, key: bytes, cutoff: float) -> bool:
        last = self._recent.get(key)  # None too where the tier keeps no recency (no TTL)
        return last is not None and last < cutoff

    def _push(self, key: bytes, score: Score | None) -> None:
        self._sequence += 1
        sequence = self._sequence
        standing = self._standing(score)
        self._current[key] = sequence
        heapq.heappush(self._heap, (standing[0], standing[1], standing[2], sequence, key))
        if len(self._heap) > 2 * len(self._current) + 1024:
            self._compact()

    def _compact(self) -> None:
        current = self._current
        self._heap = [item for item in self._heap if current.get(item[4]) == item[3]]
        heapq.heapify(self._heap)
