"""Free-slot bookkeeping for the GPU tier: runs of contiguous slots, first fit, merged on free;
and `Allocation`, the slots one object holds.

An object spans ⌈size / slot_size⌉ *contiguous* slots so that a pinned object is one tensor view
(zero copy). Free space is kept as extents sorted by start; single-slot requests (the common case
for KV blocks sized to the slot) take the last slot of the last extent in O(1).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tierkv._untracked import untrack
from tierkv.formats.value import ObjectMeta


@dataclass(slots=True, eq=False)
class Allocation:
    """Slots held by one object; live `pins` or lent `views` keep them from being freed."""

    start: int
    count: int
    meta: ObjectMeta
    pins: int = 0
    views: int = 0  # tensors lent out by pins that are still alive somewhere (`_lending`)
    detached: bool = False  # its key was deleted or overwritten while pinned or viewed
    freed: bool = False

    def __post_init__(self) -> None:
        untrack(self)  # atoms only: no cycle can pass through it (`tierkv._untracked`)


class SlotAllocator:
    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._starts: list[int] = [0] if total else []
        self._lengths: dict[int, int] = {0: total} if total else {}

    def can_allocate(self, count: int) -> bool:
        if count <= 1:
            return self.free >= count
        if count > self.free:
            return False
        return any(length >= count for length in self._lengths.values())

    def allocate(self, count: int) -> int | None:
        """Start of `count` contiguous slots now taken; ``None`` if no free run is long enough."""
        if count == 0:
            return 0
        if count > self.free:
            return None
        if count == 1:
            start = self._starts[-1]
            return self._take_tail(start, 1)
        for start in self._starts:
            if self._lengths[start] >= count:
                return self._take_tail(start, count)
        return None

    def _take_tail(self, start: int, count: int) -> int:
        length = self._lengths[start]
        if length == count:
            del self._lengths[start]
            self._starts.pop(bisect.bisect_left(self._starts, start))
        else:
            self._lengths[start] = length - count
        self.free -= count
        return start + length - count

    def release(self, start: int, count: int) -> None:
        """Give back a run taken by `allocate`, merging it with free neighbours."""
        if count == 0:
            return
        position = bisect.bisect_left(self._starts, start)
        if position > 0:
            before = self._starts[position - 1]
            if before + self._lengths[before] == start:
                self._lengths[before] += count
                self.free += count
                self._merge_next(before, position)
                return
        self._starts.insert(position, start)
        self._lengths[start] = count
        self.free += count
        self._merge_next(start, position + 1)

    def _merge_next(self, start: int, next_position: int) -> None:
        if next_position < len(self._starts):
            following = self._starts[next_position]
            if start + self._lengths[start] == following:
                self._lengths[start] += self._lengths.pop(following)
                self._starts.pop(next_position)
