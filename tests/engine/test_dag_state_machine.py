"""A state machine over put (with parents) / get / invalidate / add_dependency / flush / reopen
against a model of values and edges, on all three tiers (large enough that nothing is dropped,
so the model is exact).

The model's DAG: a put sets the key's parents (replacing the old ones; an old parent that holds
no value is released, as below) and, if the key held a value or anything derives from it (an
old value that left keeps its children's edges), removes everything derived from it;
`invalidate` removes the key and its descendants and
returns how many stored objects went; a key that leaves (or is invalidated unstored) drops the
edges from its parents unless something still derives from it, and each parent that holds no
value and is left without children is released the same way, up the chain
(`Dag.unlink_parents`);
`add_dependency` to a stored child writes the edge into the child's header (it survives a
reopen); to a key not stored it lives in memory and in the engine's record of such edges, so
a reopen rebuilds the edges from the stored objects' headers and links the recorded ones again
where a stored object derives from their child, directly or through other recorded keys
(`engine._departed`). A put or link that would close a cycle is refused and changes nothing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tierkv
from tests.engine._configs import hierarchy_config
from tierkv import DependencyCycleError

KEYS = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f"])
VALUES = st.binary(min_size=1, max_size=48)


class DagMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.directory = Path(tempfile.mkdtemp(prefix="tierkv-dag-"))
        self.config = hierarchy_config(self.directory, ("gpu", "pmem", "nvme"),
                                       gpu={"slot_size": 4096, "capacity": 16 * 1024})
        self.kv = self.run(tierkv.open(self.config))
        self.values: dict[bytes, bytes] = {}
        self.durable: dict[bytes, set[bytes]] = {}  # a stored key's parents from its put
        self.edges: set[tuple[bytes, bytes]] = set()

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    # -- the model's DAG --------------------------------------------------------------------
    def descendants(self, key: bytes) -> set[bytes]:
        found: set[bytes] = set()
        frontier = [key]
        while frontier:
            node = frontier.pop()
            for parent, child in self.edges:
                if parent == node and child not in found:
                    found.add(child)
                    frontier.append(child)
        return found

    def leave(self, key: bytes) -> int:
        """`key` leaves the cache (if stored): its value, and its edges as `release` says."""
        self.durable.pop(key, None)
        stored = self.values.pop(key, None) is not None
        self.release(key)
        return int(stored)

    def release(self, key: bytes) -> None:
        """`key` holds no value: unless something derives from it, drop the edges from its
        parents, and release in turn each parent that holds no value, up the chain."""
        pending = [key]
        while pending:
            node = pending.pop()
            if any(parent == node for parent, _ in self.edges):
                continue  # its children still derive from its parents through it
            parents = {parent for parent, child in self.edges if child == node}
            self.edges -= {(parent, node) for parent in parents}
            pending.extend(parent for parent in parents if parent not in self.values)

    def remove_descendants(self, key: bytes) -> int:
        return sum(self.leave(child) for child in self.descendants(key))

    # -- rules ------------------------------------------------------------------------------
    @rule(key=KEYS, value=VALUES, parents=st.lists(KEYS, max_size=2, unique=True))
    def put(self, key: bytes, value: bytes, parents: list[bytes]) -> None:
        cycle = key in parents or any(key == p or p in self.descendants(key) for p in parents)
        if cycle:
            try:
                self.run(self.kv.put(key, value, parents=parents))
            except DependencyCycleError:
                return
            raise AssertionError("a cycle was accepted")
        self.run(self.kv.put(key, value, parents=parents))
        rewrites = key in self.values or any(p == key for p, _ in self.edges)
        dropped = {p for p, c in self.edges if c == key} - set(parents)
        self.edges = {(p, c) for p, c in self.edges if c != key} | {(p, key) for p in parents}
        for parent in dropped - self.values.keys():
            self.release(parent)
        self.values[key] = value  # held while what derived from its old value leaves
        self.durable[key] = set(parents)
        if rewrites:
            self.remove_descendants(key)

    @rule(key=KEYS)
    def get(self, key: bytes) -> None:
        assert self.run(self.kv.get(key)) == self.values.get(key)

    @rule(key=KEYS)
    def invalidate(self, key: bytes) -> None:
        removed = self.run(self.kv.invalidate(key))
        expected = self.leave(key) + self.remove_descendants(key)
        assert removed == expected

    @rule(parent=KEYS, child=KEYS)
    def add_dependency(self, parent: bytes, child: bytes) -> None:
        if parent == child or parent in self.descendants(child):
            try:
                self.run(self.kv.add_dependency(parent, child))
            except DependencyCycleError:
                return
            raise AssertionError("a cycle was accepted")
        self.run(self.kv.add_dependency(parent, child))
        self.edges.add((parent, child))
        if child in self.durable:
            self.durable[child].add(parent)

    @rule()
    def flush(self) -> None:
        self.run(self.kv.flush())

    @precondition(lambda self: True)
    @rule()
    def reopen(self) -> None:
        self.run(self.kv.close())
        self.kv = self.run(tierkv.open(self.config))
        # what comes back: the stored objects, the edges their headers name, and the recorded
        # edges into keys not stored where something stored derives from them
        edges = {(p, key) for key, parents in self.durable.items() for p in parents}
        recorded = {(p, c) for p, c in self.edges if c not in self.values}
        while more := {edge for edge in recorded - edges if edge[1] in {p for p, _ in edges}}:
            edges |= more
        self.edges = edges

    @invariant()
    def every_value_as_the_model_says(self) -> None:
        keys = sorted(self.values)
        assert self.run(self.kv.get_many(keys)) == [self.values[k] for k in keys]

    def teardown(self) -> None:
        try:
            self.run(self.kv.close())
        finally:
            self.loop.close()
            shutil.rmtree(self.directory, ignore_errors=True)


TestDagMachine = DagMachine.TestCase
# Derandomized (the same examples every run, so that CI tells a change from a new sequence)
# unless DAG_SM_RANDOM is set: a bug hunt sets it, with DAG_SM_EXAMPLES in the hundreds. The
# random runs of session 29 found a put's cascade releasing the parent it was about to link
# (fixed: `EngineState.linking`) and a model that did not release the parents a put drops as
# the engine does (fixed in the model); session 30 ran 900 random examples clean.
TestDagMachine.settings = settings(
    max_examples=int(os.environ.get("DAG_SM_EXAMPLES", "25")), stateful_step_count=25,
    deadline=None, derandomize=not os.environ.get("DAG_SM_RANDOM"),
    suppress_health_check=[HealthCheck.too_slow])
