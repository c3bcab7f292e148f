"""The write-invalidation DAG: edges, cycle refusal, cuts and subtree removal, cost and memory."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import pairwise

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierkv.engine.dag import Dag, DependencyCycleError, measure_edge_bytes
from tierkv.errors import TierKVError


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def chain(dag: Dag, nodes: Sequence[bytes]) -> None:
    for parent, child in pairwise(nodes):
        dag.link(parent, child)


def snapshot(dag: Dag) -> dict[bytes, frozenset[bytes]]:
    """Every node's children: what a refused change must leave exactly as it was."""
    return {key: dag.children(key) for key in dag}


def distances(edges: Iterable[tuple[bytes, bytes]], start: bytes) -> dict[bytes, int]:
    """Shortest distance from `start` to every key reachable from it, by brute force."""
    edges = list(edges)
    found = {start: 0}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for parent, child in edges:
            if parent == node and child not in found:
                found[child] = found[node] + 1
                queue.append(child)
    del found[start]
    return found


def assert_bfs_order(order: list[bytes], dist: dict[bytes, int]) -> None:
    assert len(order) == len(set(order))
    assert set(order) == set(dist)
    levels = [dist[key] for key in order]
    assert levels == sorted(levels)


# -- links and descendants -------------------------------------------------------------------------

def test_chain_descendants_in_order() -> None:
    dag = Dag()
    nodes = keys("b", 6)
    chain(dag, nodes)
    assert dag.descendants(nodes[0]) == nodes[1:]
    assert dag.descendants(nodes[3]) == nodes[4:]
    assert dag.descendants(nodes[-1]) == []
    assert len(dag) == 6
    assert dag.edges == 5


def test_tree_descendants_breadth_first() -> None:
    dag = Dag()
    root, (a, b), (a1, a2, b1) = b"r", keys("l1-", 2), keys("l2-", 3)
    dag.link_all([root], a)
    dag.link(root, b)
    dag.link(a, a1)
    dag.link(a, a2)
    dag.link(b, b1)
    order = dag.descendants(root)
    assert set(order[:2]) == {a, b}
    assert set(order[2:]) == {a1, a2, b1}
    assert dag.children(root) == {a, b}
    assert dag.parents(a1) == {a}


def test_diamond_key_listed_once() -> None:
    dag = Dag()
    top, left, right, bottom, below = b"top", b"left", b"right", b"bottom", b"below"
    dag.link(top, left)
    dag.link(top, right)
    dag.link_all([left, right], bottom)
    dag.link(bottom, below)
    dag.link(top, below)
    order = dag.descendants(top)
    assert len(order) == 4
    assert set(order) == {left, right, bottom, below}
    assert order.index(below) < order.index(bottom)  # one step from top, bottom is two
    assert dag.parents(bottom) == {left, right}
    assert dag.parents(below) == {bottom, top}


def test_link_is_idempotent() -> None:
    dag = Dag()
    dag.link(b"a", b"b")
    dag.link(b"a", b"b")
    dag.link_all([b"a", b"a"], b"b")
    assert dag.edges == 1
    assert len(dag) == 2
    assert dag.children(b"a") == {b"b"}


def test_unknown_key_is_empty() -> None:
    dag = Dag()
    dag.link(b"a", b"b")
    assert b"zz" not in dag
    assert b"a" in dag
    assert dag.descendants(b"zz") == []
    assert dag.parents(b"zz") == frozenset()
    assert dag.children(b"zz") == frozenset()
    assert dag.has_children(b"a") and not dag.has_children(b"b")
    assert not dag.has_children(b"zz")
    dag.cut(b"zz")
    assert dag.edges == 1


def test_link_all_of_nothing_is_a_no_op() -> None:
    dag = Dag()
    dag.link_all([], b"a")
    assert len(dag) == 0
    assert b"a" not in dag


def test_key_must_be_bytes() -> None:
    dag = Dag()
    with pytest.raises(TypeError):
        dag.link("a", b"b")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dag.link_all([b"a", "b"], b"c")  # type: ignore[list-item]
    assert len(dag) == 0


def test_set_neighbours_shrink_back() -> None:
    """A key going from several neighbours back to one still answers as before."""
    dag = Dag()
    dag.link_all([b"p1", b"p2", b"p3"], b"c")
    dag.cut(b"p2")
    dag.cut(b"p3")
    assert dag.parents(b"c") == {b"p1"}
    dag.link(b"p4", b"c")
    assert dag.parents(b"c") == {b"p1", b"p4"}
    assert dag.edges == 2


# -- cycles ----------------------------------------------------------------------------------------

def test_self_loop_refused() -> None:
    dag = Dag()
    with pytest.raises(DependencyCycleError) as caught:
        dag.link(b"a", b"a")
    assert (caught.value.raw_parent, caught.value.raw_child) == (b"a", b"a")
    assert isinstance(caught.value, TierKVError)
    assert len(dag) == 0


def test_two_cycle_refused() -> None:
    dag = Dag()
    dag.link(b"a", b"b")
    before = snapshot(dag)
    with pytest.raises(DependencyCycleError) as caught:
        dag.link(b"b", b"a")
    assert (caught.value.raw_parent, caught.value.raw_child) == (b"b", b"a")
    assert snapshot(dag) == before
    assert dag.edges == 1


def test_long_cycle_refused_and_dag_unchanged() -> None:
    dag = Dag()
    nodes = keys("block-", 10_000)
    chain(dag, nodes)
    before = snapshot(dag)
    with pytest.raises(DependencyCycleError):
        dag.link(nodes[-1], nodes[0])
    with pytest.raises(DependencyCycleError):
        dag.link(nodes[5_000], nodes[10])
    assert snapshot(dag) == before
    assert dag.edges == 9_999
    assert dag.descendants(nodes[0]) == nodes[1:]


def test_link_all_is_all_or_nothing() -> None:
    dag = Dag()
    chain(dag, [b"a", b"b", b"c"])
    dag.link(b"x", b"y")
    before = snapshot(dag)
    with pytest.raises(DependencyCycleError) as caught:
        dag.link_all([b"x", b"fresh", b"c", b"y"], b"a")
    assert caught.value.raw_child == b"a"
    assert caught.value.raw_parent == b"c"
    with pytest.raises(DependencyCycleError):
        dag.link_all([b"fresh", b"a"], b"a")
    assert snapshot(dag) == before
    assert b"fresh" not in dag
    dag.link_all([b"x", b"fresh", b"y"], b"a")
    assert dag.parents(b"a") == {b"x", b"fresh", b"y"}


def test_cycle_error_names_the_closing_parent() -> None:
    """The search meets somewhere between child and parent; the error still names the edge."""
    dag = Dag()
    nodes = keys("n", 8)
    chain(dag, nodes)
    chain(dag, [b"o2", b"o1", b"other"])
    with pytest.raises(DependencyCycleError) as caught:
        dag.link_all([b"other", nodes[-1]], nodes[0])
    assert (caught.value.raw_parent, caught.value.raw_child) == (nodes[-1], nodes[0])


def test_edge_across_branches_is_not_a_cycle() -> None:
    dag = Dag()
    dag.link(b"root", b"a")
    dag.link(b"root", b"b")
    dag.link(b"a", b"b")  # root -> a -> b and root -> b: a diamond, not a cycle
    with pytest.raises(DependencyCycleError):
        dag.link(b"b", b"root")
    assert dag.descendants(b"root") in ([b"a", b"b"], [b"b", b"a"])


def test_cycle_error_message_is_short_for_long_keys() -> None:
    dag = Dag()
    long = b"k" * 4096
    dag.link(long, b"b")
    with pytest.raises(DependencyCycleError) as caught:
        dag.link(b"b", long)
    assert len(str(caught.value)) < 200


# -- cut and remove_subtree ------------------------------------------------------------------------

def test_cut_forgets_edges_and_bare_neighbours() -> None:
    dag = Dag()
    dag.link(b"p", b"k")
    dag.link(b"k", b"c")
    dag.link(b"p", b"other")
    dag.cut(b"k")
    assert b"k" not in dag
    assert b"c" not in dag  # its only edge was to k
    assert dag.children(b"p") == {b"other"}
    assert len(dag) == 2
    assert dag.edges == 1
    dag.cut(b"other")
    assert len(dag) == 0  # the parent, left with nothing, is not kept as garbage
    assert list(dag) == []


def test_remove_subtree_removes_exactly_the_descendants() -> None:
    dag = Dag()
    dag.link(b"keep", b"kept-child")
    dag.link(b"gone", b"g1")
    dag.link(b"g1", b"g2")
    dag.link(b"above", b"gone")
    dag.link_all([b"g1", b"keep"], b"shared")  # derives from gone (via g1) and from keep
    dag.link(b"shared", b"shared-child")
    removed = dag.remove_subtree(b"gone")
    assert removed[0] == b"gone"
    assert set(removed) == {b"gone", b"g1", b"g2", b"shared", b"shared-child"}
    assert len(removed) == 5
    for key in removed:
        assert key not in dag
    assert dag.children(b"keep") == {b"kept-child"}
    assert b"above" not in dag  # its one edge went with gone
    assert set(dag) == {b"keep", b"kept-child"}
    assert dag.edges == 1


def test_remove_subtree_of_unknown_key_lists_the_key() -> None:
    dag = Dag()
    dag.link(b"a", b"b")
    assert dag.remove_subtree(b"zz") == [b"zz"]
    assert dag.edges == 1


def test_remove_version_node_removes_its_chains_only() -> None:
    dag = Dag()
    llama, mistral = b"\x00model:llama@1", b"\x00model:mistral@3"
    chains = [keys("llama-a-", 50), keys("llama-b-", 50), keys("mistral-", 50)]
    for blocks in chains:
        chain(dag, blocks)
    for version, blocks in ((llama, chains[0]), (llama, chains[1]), (mistral, chains[2])):
        for block in blocks:
            dag.link(version, block)
    removed = dag.remove_subtree(llama)
    assert removed[0] == llama
    assert set(removed[1:]) == set(chains[0]) | set(chains[1])
    assert len(removed) == 101
    assert set(dag) == {mistral, *chains[2]}
    assert sorted(dag.descendants(mistral)) == sorted(chains[2])
    assert dag.edges == 49 + 50


def test_long_chain_is_walked_without_recursion() -> None:
    dag = Dag()
    nodes = keys("b", 100_000)
    chain(dag, nodes)
    assert dag.descendants(nodes[0]) == nodes[1:]
    assert dag.remove_subtree(nodes[50_000]) == nodes[50_000:]
    assert dag.edges == 49_999
    assert dag.remove_subtree(nodes[0]) == nodes[:50_000]
    assert len(dag) == 0
    assert dag.edges == 0


# -- cost: counted with keys that count their hashing ----------------------------------------------

class CountingKey(bytes):
    """A key that counts how often it is hashed: every dict or set probe hashes its key once, so
    the count over a call bounds the number of nodes the call touched."""

    hashes = 0

    def __hash__(self) -> int:
        CountingKey.hashes += 1
        return bytes.__hash__(self)


def counted_chain(n: int) -> tuple[Dag, list[CountingKey]]:
    dag = Dag()
    nodes = [CountingKey(key) for key in keys("b", n)]
    chain(dag, nodes)
    return dag, nodes


def hashes_of(call: Callable[[], object]) -> int:
    CountingKey.hashes = 0
    call()
    return CountingKey.hashes


def test_cost_does_not_depend_on_graph_size() -> None:
    dag, nodes = counted_chain(200_000)
    leaf, near_leaf = nodes[-1], nodes[-3]
    fresh = CountingKey(b"fresh")

    assert hashes_of(lambda: dag.descendants(leaf)) <= 4
    assert hashes_of(lambda: dag.descendants(near_leaf)) <= 12
    # appending to the chain, then an edge across the head of the graph
    assert hashes_of(lambda: dag.link(leaf, fresh)) <= 40
    assert hashes_of(lambda: dag.link(nodes[0], fresh)) <= 40
    assert hashes_of(lambda: dag.remove_subtree(fresh)) <= 40
    removed: list[bytes] = []
    assert hashes_of(lambda: removed.extend(dag.remove_subtree(near_leaf))) <= 60
    assert removed == nodes[-3:]
    assert dag.edges == 199_999 - 3


def test_hanging_a_built_chain_under_a_version_node_is_cheap() -> None:
    """Either end may be linked first: a version node over an existing chain, or a chain built
    tail first under an existing version node, costs O(1) per link, not the chain's length."""
    dag, nodes = counted_chain(20_000)
    version = CountingKey(b"\x00model:m")
    assert max(hashes_of(partial(dag.link, version, block)) for block in nodes) <= 40

    reverse = Dag()
    tail_first = [CountingKey(key) for key in keys("r", 20_000)]
    for block in tail_first:
        reverse.link(version, block)
    costs = [hashes_of(partial(reverse.link, tail_first[i], tail_first[i + 1]))
             for i in reversed(range(len(tail_first) - 1))]
    assert max(costs) <= 60
    assert reverse.descendants(tail_first[0]) == tail_first[1:]


# -- memory ----------------------------------------------------------------------------------------

def test_memory_per_edge_is_compact() -> None:
    per_chain_edge = measure_edge_bytes(10_000)
    per_tree_edge = measure_edge_bytes(10_000, fanout=8)
    assert 0 < per_chain_edge < 400
    assert 0 < per_tree_edge < 400


def test_measure_edge_bytes_refuses_empty_graphs() -> None:
    with pytest.raises(ValueError):
        measure_edge_bytes(1)


# -- against a naive model -------------------------------------------------------------------------

ALPHABET = keys("k", 7)
key_strategy = st.sampled_from(ALPHABET)


class DagMachine(RuleBasedStateMachine):
    """The DAG against a set of edges with brute-force reachability."""

    def __init__(self) -> None:
        super().__init__()
        self.dag = Dag()
        self.model: set[tuple[bytes, bytes]] = set()
        #: cut or removed keys not linked again since: nothing may point at them
        self.gone: set[bytes] = set()

    def closes_cycle(self, parent: bytes, child: bytes) -> bool:
        return parent == child or parent in distances(self.model, child)

    def linked(self, parents: Iterable[bytes], child: bytes) -> None:
        for parent in parents:
            self.model.add((parent, child))
            self.gone.discard(parent)
        self.gone.discard(child)

    def forget(self, key: bytes) -> None:
        self.model = {(p, c) for p, c in self.model if key not in (p, c)}
        self.gone.add(key)

    @rule(parent=key_strategy, child=key_strategy)
    def link(self, parent: bytes, child: bytes) -> None:
        if self.closes_cycle(parent, child):
            with pytest.raises(DependencyCycleError):
                self.dag.link(parent, child)
        else:
            self.dag.link(parent, child)
            self.linked([parent], child)

    @rule(parents=st.lists(key_strategy, max_size=3), child=key_strategy)
    def link_all(self, parents: list[bytes], child: bytes) -> None:
        if any(self.closes_cycle(parent, child) for parent in parents):
            with pytest.raises(DependencyCycleError):
                self.dag.link_all(parents, child)
        else:
            self.dag.link_all(parents, child)
            self.linked(parents, child)

    @rule(key=key_strategy)
    def cut(self, key: bytes) -> None:
        self.dag.cut(key)
        self.forget(key)

    @rule(key=key_strategy)
    def remove_subtree(self, key: bytes) -> None:
        expected = distances(self.model, key)
        removed = self.dag.remove_subtree(key)
        assert removed[0] == key
        assert_bfs_order(removed[1:], expected)
        for gone in removed:
            self.forget(gone)

    @invariant()
    def matches_model(self) -> None:
        nodes = {p for p, _ in self.model} | {c for _, c in self.model}
        assert self.dag.edges == len(self.model)
        assert len(self.dag) == len(nodes)
        assert sorted(self.dag) == sorted(nodes)  # each node once
        for key in ALPHABET:
            assert (key in self.dag) == (key in nodes)
            assert self.dag.children(key) == {c for p, c in self.model if p == key}
            assert self.dag.parents(key) == {p for p, c in self.model if c == key}
            assert_bfs_order(self.dag.descendants(key), distances(self.model, key))

    @invariant()
    def nothing_points_at_a_gone_key(self) -> None:
        for key in self.gone:
            assert key not in self.dag
        for key in ALPHABET:
            assert not (self.dag.children(key) | self.dag.parents(key)) & self.gone


DagMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestDagMachine = DagMachine.TestCase
