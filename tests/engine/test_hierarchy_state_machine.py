"""A hypothesis state machine of the whole hierarchy (gpu on the CPU → pmem → nvme) against a
model, under both write policies, with drops out of the last tier.

The tiers are tiny (a 256 KiB gpu, the smallest pool PMDK takes, a log of four 1 MiB regions)
and a `spill` rule puts objects of up to 900 KiB, so demotions, promotions and drops out of the
log happen within a few steps. The model cannot know which object a drop takes, so after every
step it asks the engine which keys it holds (`contains`, in one step of the loop, with the
`drops` and `cascaded` counters of `stats()`) and reads the step's departures from those.

Properties:

- a read (`get`, `get_many`) is a miss or exactly the last value put for that key, never another
  key's bytes, a deleted, invalidated or overwritten value; right after a reopen too; a key the
  engine holds from before a `get` to after it is served;
- a key the engine holds is one the model has a value for, and keys leave the engine only as
  the step's counters say (a delete, an invalidation, a cascade, a drop): none vanishes;
- after `invalidate(k)` or a new value of `k`, no descendant of `k` is held when no drop ran
  during the step (a drop of an object in the middle of a chain can cut the chain, see below);
  `invalidate` counts what it removed; a put or `add_dependency` closing a cycle is refused;
- tiers never exceed their capacity;
- a clean close and reopen keeps every object held before the close (under `write_through`
  every acknowledged put is durable; under `write_back` the close flushes, so this is more than
  what a returned `flush()` covered), but for as many as the close dropped for space; the
  reopened engine holds nothing it did not hold before.

The model's DAG is the engine's as documented (docs/architecture.md, "Invalidation"): a put
sets the key's parents, `add_dependency` adds one (written into a stored child's header, in
memory only for a child not stored), and an object that leaves the cache (deleted, dropped,
invalidated) drops the edges from its parents once nothing derives from it, walking up
through parents that hold no object: `a` still reaches `c` put with parent `b` put with parent
`a` after `b` left. A reopen rebuilds the edges from the held objects' headers, and links
again the edges into keys that held no object at the close (its flush records them:
`engine._departed`) wherever a held object still derives from that key, directly or through
other such keys; an edge into a key dropped by the close itself may or may not come back.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config
from tests.engine.test_engine_state_machine import same
from tierkv import DependencyCycleError

Key = str | bytes
Value = bytes | torch.Tensor
T = TypeVar("T")

#: keys of the DAG rules (b"k0" is another key than "k0")
KEYS: list[Key] = [f"k{i}" for i in range(6)] + [b"k0"]
#: keys the spill rule fills the hierarchy with (each may also be read, deleted, a parent)
SPILL: list[Key] = [f"s{i}" for i in range(20)]
ALL: list[Key] = KEYS + SPILL
#: parents a put or `add_dependency` names: mostly the DAG keys, so that chains form
PARENTS = st.sampled_from(KEYS + SPILL[:3])

SIZES = st.one_of(st.integers(0, 4 * KiB), st.integers(4 * KiB, 200 * KiB),
                  st.integers(200 * KiB, 900 * KiB))
LARGE = st.integers(700 * KiB, 900 * KiB)

#: `HIERARCHY_SM_EXAMPLES=300` runs more examples (a bug hunt); CI runs the default
EXAMPLES = int(os.environ.get("HIERARCHY_SM_EXAMPLES", "20"))
STEPS = int(os.environ.get("HIERARCHY_SM_STEPS", "40"))


#: tmpfs where the machine has one: msync and fdatasync on a disk made each example seconds
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def make_value(size: int, tensor: bool, seed: int) -> Value:
    """`size` random bytes from `seed` (each put has its own), or an int32 tensor of them."""
    data = random.Random(seed).randbytes(size)
    if not tensor:
        return data
    if size < 4:
        return torch.zeros(0, dtype=torch.int32)
    return torch.frombuffer(bytearray(data[: size // 4 * 4]), dtype=torch.int32).clone()


@dataclass(frozen=True, slots=True)
class Seen:
    """What one step of the loop saw: the keys held and the counters of departures."""

    held: frozenset[Key]
    drops: int
    cascaded: int


class HierarchyMachine(RuleBasedStateMachine):
    write_policy = "write_back"

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="tierkv-hsm-", dir=SCRATCH))
        self.config = hierarchy_config(
            self.directory, ("gpu", "pmem", "nvme"), write_policy=self.write_policy,
            gpu={"capacity": 256 * KiB, "slot_size": 16 * KiB, "ttl": "60s"},
            pmem={"capacity": 8 * MiB},
            nvme={"capacity": 4096 + 4 * MiB, "region_size": MiB, "direct": False,
                  "backend": "threads"},
        )
        self.loop = asyncio.new_event_loop()
        self.kv = self.run(tierkv.open(self.config))
        self.seed = 0
        #: the last value put of each key that may still be served (absent: must miss)
        self.values: dict[Key, Value] = {}
        #: edges parent -> child the engine's DAG holds for certain, and those it may hold
        self.edges: set[tuple[Key, Key]] = set()
        self.maybe_edges: set[tuple[Key, Key]] = set()
        #: the parents a held key's stored header names (what a reopen rebuilds edges from)
        self.header: dict[Key, set[Key]] = {}
        self.seen = self.observe()

    def run(self, coroutine: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coroutine)

    # -- observing the engine ---------------------------------------------------------------
    def observe(self) -> Seen:
        async def look() -> Seen:
            # no await here suspends (contains is synchronous inside): one step of the loop
            held = frozenset([key for key in ALL if await self.kv.contains(key)])
            stats = self.kv.stats()
            for name, tier in stats["tiers"].items():
                assert tier["used"] <= tier["capacity"], f"{name} over capacity"
            return Seen(held, stats["engine"]["drops"], stats["engine"]["cascaded"])

        return self.run(look())

    def step_end(self, removed: int = 0, *, with_cascaded: bool = False) -> tuple[Seen, Seen]:
        """After a step: see what the engine holds, check that nothing left it unaccounted for
        (`removed`: what the step's own delete or invalidate reported, `with_cascaded`: the
        cascade's removals included) and that it holds nothing the model has no value for,
        and drop the edges into each key that left."""
        before, after = self.seen, self.observe()
        self.seen = after
        left = before.held - after.held
        cascaded = after.cascaded - before.cascaded
        departures = after.drops - before.drops + removed + (0 if with_cascaded else cascaded)
        assert len(left) <= departures, f"{sorted(map(repr, left))} vanished"
        stray = [key for key in after.held if key not in self.values]
        assert not stray, f"the engine holds {stray!r}, deleted or invalidated"
        for key in left:
            self.leave(key)
        if after.drops > before.drops:
            event("a step with drops")
        if cascaded:
            event("a step with a cascade")
        return before, after

    # -- the model's DAG --------------------------------------------------------------------
    def descendants(self, key: Key, edges: Iterable[tuple[Key, Key]]) -> set[Key]:
        children: dict[Key, list[Key]] = {}
        for parent, child in edges:
            children.setdefault(parent, []).append(child)
        found: set[Key] = set()
        frontier = [key]
        while frontier:
            for child in children.get(frontier.pop(), ()):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
        return found

    def both(self, key: Key) -> tuple[set[Key], set[Key]]:
        """`key`'s descendants through certain edges, and through certain or maybe edges."""
        return (self.descendants(key, self.edges),
                self.descendants(key, self.edges | self.maybe_edges))

    def leave(self, key: Key) -> None:
        """`key` left the cache (or was deleted): the edges from its parents go with it once
        nothing derives from it, and so, up the chain, do those of each parent that holds no
        object and is left without children (what derives from a departed key still derives
        from its ancestors through it)."""
        self.header.pop(key, None)
        pending = [key]
        while pending:
            node = pending.pop()
            if any(p == node for p, _ in self.edges | self.maybe_edges):
                continue
            parents = {p for p, c in self.edges | self.maybe_edges if c == node}
            self.edges = {(p, c) for p, c in self.edges if c != node}
            self.maybe_edges = {(p, c) for p, c in self.maybe_edges if c != node}
            pending.extend(p for p in parents if p not in self.seen.held)

    def cascade(self, certain: set[Key], possible: set[Key], before: Seen, after: Seen) -> None:
        """The step removed what derives from a key: `certain` through edges the engine held,
        `possible` through edges it may have held. A drop during the step may have cut a path
        before the cascade walked it; without one, every certain descendant is gone."""
        dropped = after.drops > before.drops
        cascaded = after.cascaded - before.cascaded
        assert cascaded <= len(possible & before.held)
        for key in possible:
            if key in after.held:
                assert dropped or key not in certain, f"{key!r} derives from it and is held"
                continue  # not reached: a drop in the middle cut it off, or a maybe edge
            if key in certain or key in before.held:
                # gone, cascaded (or dropped): removed for good unless a drop makes it unclear
                if not dropped:
                    self.values.pop(key, None)
                self.leave(key)
            else:
                # reached (its edges went) only if the maybe edges on the way were there
                into = {(p, c) for p, c in self.edges if c == key}
                self.edges -= into
                self.maybe_edges |= into

    @staticmethod
    def restored(edges: set[tuple[Key, Key]], recorded: set[tuple[Key, Key]]
                 ) -> set[tuple[Key, Key]]:
        """`edges`, and each `recorded` edge whose child is a parent in the result (linked
        again at open only where something derives from the key), repeated until none is
        added."""
        result = set(edges)
        while True:
            parents = {p for p, _ in result}
            more = {edge for edge in recorded - result if edge[1] in parents}
            if not more:
                return result
            result |= more

    def cycle(self, parents: Iterable[Key], child: Key) -> tuple[bool, bool]:
        """Whether linking `parents` -> `child` closes a cycle for certain, and whether it may."""
        named = set(parents)
        certain, possible = self.both(child)
        return (child in named or bool(named & certain),
                child in named or bool(named & possible))

    # -- rules ------------------------------------------------------------------------------
    def put_one(self, key: Key, size: int, tensor: bool, parents: list[Key]) -> None:
        self.seed += 1
        value = make_value(size, tensor, self.seed)
        closes, may_close = self.cycle(parents, key)
        try:
            self.run(self.kv.put(key, value, parents=parents))
        except DependencyCycleError:
            assert may_close, "a put that closes no cycle was refused"
            self.step_end()
            return
        assert not closes, "a put that closes a cycle was accepted"
        self.edges = {(p, c) for p, c in self.edges if c != key} | {(p, key) for p in parents}
        self.maybe_edges = {(p, c) for p, c in self.maybe_edges if c != key}
        self.values[key] = value.clone() if isinstance(value, torch.Tensor) else value
        certain, possible = self.both(key)
        before, after = self.step_end()
        if key in after.held:
            self.header[key] = set(parents)
        else:  # dropped already
            self.leave(key)
        self.cascade(certain, possible, before, after)

    @rule(key=st.sampled_from(KEYS), size=SIZES, tensor=st.booleans(),
          parents=st.lists(PARENTS, max_size=2, unique=True))
    def put(self, key: Key, size: int, tensor: bool, parents: list[Key]) -> None:
        self.put_one(key, size, tensor, parents)

    @rule(keys=st.lists(st.sampled_from(SPILL), min_size=3, max_size=10, unique=True),
          size=LARGE)
    def spill(self, keys: list[Key], size: int) -> None:
        for key in keys:
            self.put_one(key, size, False, [])

    @rule(key=st.sampled_from(ALL))
    def get(self, key: Key) -> None:
        got = self.run(self.kv.get(key))
        before, after = self.step_end()
        if got is None:
            assert not (key in before.held and key in after.held), f"{key!r} held, not served"
        else:
            assert key in self.values, f"{key!r} deleted or invalidated, served"
            assert same(got, self.values[key]), f"{key!r}: not its last value"

    @rule(keys=st.lists(st.sampled_from(ALL), max_size=6))
    def get_many(self, keys: list[Key]) -> None:
        got = self.run(self.kv.get_many(keys))
        before, after = self.step_end()
        for key, value in zip(keys, got, strict=True):
            if value is None:
                assert not (key in before.held and key in after.held), f"{key!r} not served"
            else:
                assert key in self.values and same(value, self.values[key]), repr(key)

    @rule(key=st.sampled_from(ALL))
    def delete(self, key: Key) -> None:
        held = self.run(self.kv.delete(key))
        assert self.run(self.kv.get(key)) is None
        self.values.pop(key, None)
        before, _ = self.step_end(removed=int(held))
        assert held or key not in before.held or self.seen.drops > before.drops
        self.leave(key)  # a delete unlinks the key from its parents, held or not

    @rule(key=PARENTS)
    def invalidate(self, key: Key) -> None:
        certain, possible = self.both(key)
        removed = self.run(self.kv.invalidate(key))
        self.values.pop(key, None)
        before, after = self.step_end(removed=removed, with_cascaded=True)
        self.leave(key)
        self.cascade(certain, possible, before, after)
        if after.drops == before.drops and not possible - certain:
            assert removed == len(({key} | certain) & before.held)
        assert removed <= len(({key} | possible) & before.held)
        assert self.run(self.kv.get(key)) is None

    @rule(parent=PARENTS, child=st.sampled_from(KEYS))
    def add_dependency(self, parent: Key, child: Key) -> None:
        closes, may_close = self.cycle([parent], child)
        try:
            self.run(self.kv.add_dependency(parent, child))
        except DependencyCycleError:
            assert may_close, "an edge that closes no cycle was refused"
            self.step_end()
            return
        assert not closes, "an edge that closes a cycle was accepted"
        before, after = self.step_end()
        if child in after.held or child not in before.held:
            self.edges.add((parent, child))
            if child in after.held:
                self.header[child].add(parent)
        else:
            # dropped during the step: before the edge was made (it lives in memory) or after
            # (it went with the object)
            self.maybe_edges.add((parent, child))

    @rule()
    def flush(self) -> None:
        self.run(self.kv.flush())
        self.step_end()

    @rule()
    def settle(self) -> None:
        self.run(self.kv.settle())
        self.step_end()

    @rule()
    def reopen(self) -> None:
        self.step_end()
        before = self.seen
        self.run(self.kv.close())
        dropped = self.kv.stats()["engine"]["drops"] - before.drops
        self.kv = self.run(tierkv.open(self.config))
        self.seen = after = self.observe()
        # the open's own writes (the tiers' membership records) into a full log reclaim, and
        # drop what the reclaimed region held
        dropped += after.drops
        lost = before.held - after.held
        event("a reopen of a full cache" if len(before.held) > 8 else "a reopen")
        if dropped:
            event("a close that dropped objects")
        assert len(lost) <= dropped, f"lost over a clean close: {sorted(map(repr, lost))}"
        back = after.held - before.held
        assert not back, f"came back after a reopen: {sorted(map(repr, back))}"
        for key in lost:
            self.header.pop(key, None)
        # what a reopen knows of the DAG: the parents the held objects' headers name, and the
        # recorded edges into keys that held no object, where something held derives from them
        from_headers = {(p, key) for key in after.held for p in self.header[key]}
        departed = {(p, c) for p, c in self.edges if c not in before.held}
        # into a key the close dropped: recorded or not, as the drop came before its flush or
        # after; and a maybe edge may be there to record
        unsure = {(p, c) for p, c in self.edges | self.maybe_edges if c not in after.held}
        self.edges = self.restored(from_headers, departed)
        self.maybe_edges = self.restored(from_headers, departed | unsure) - self.edges
        keys = sorted(ALL, key=repr)
        got = self.run(self.kv.get_many(keys))
        _, end = self.step_end()
        for key, value in zip(keys, got, strict=True):
            if value is None:
                assert key not in after.held or key not in end.held, f"{key!r} not served"
            else:
                assert key in self.values and same(value, self.values[key]), repr(key)

    @invariant()
    def no_stray_edges(self) -> None:
        assert all(key in self.seen.held for key in self.header)

    def teardown(self) -> None:
        try:
            self.run(self.kv.close())
        finally:
            self.loop.close()
            shutil.rmtree(self.directory, ignore_errors=True)


class WriteThroughMachine(HierarchyMachine):
    write_policy = "write_through"


SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

TestHierarchyWriteBack = pytest.mark.pmem(HierarchyMachine.TestCase)
TestHierarchyWriteBack.settings = SETTINGS
TestHierarchyWriteThrough = pytest.mark.pmem(WriteThroughMachine.TestCase)
TestHierarchyWriteThrough.settings = SETTINGS
