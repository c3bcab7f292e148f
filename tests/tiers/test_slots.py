"""The slot allocator against a model: a hypothesis state machine over allocate/release."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv.tiers.gpu._slots import SlotAllocator

TOTAL = 24


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocator = SlotAllocator(TOTAL)
        self.taken: dict[int, int] = {}  # start -> count
        self.used = [False] * TOTAL

    @rule(count=st.integers(1, 6))
    def allocate(self, count: int) -> None:
        start = self.allocator.allocate(count)
        free_run = any(
            all(not self.used[i] for i in range(s, s + count)) for s in range(TOTAL - count + 1)
        )
        if start is None:
            assert not free_run
            return
        assert all(not self.used[i] for i in range(start, start + count))
        for i in range(start, start + count):
            self.used[i] = True
        self.taken[start] = count

    @precondition(lambda self: bool(self.taken))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        start = data.draw(st.sampled_from(sorted(self.taken)))
        count = self.taken.pop(start)
        self.allocator.release(start, count)
        for i in range(start, start + count):
            self.used[i] = False

    @rule(count=st.integers(1, 6))
    def can_allocate_agrees(self, count: int) -> None:
        free_run = any(
            all(not self.used[i] for i in range(s, s + count)) for s in range(TOTAL - count + 1)
        )
        assert self.allocator.can_allocate(count) == free_run

    @invariant()
    def free_count_matches(self) -> None:
        assert self.allocator.free == self.used.count(False)


TestSlotAllocator = SlotMachine.TestCase
