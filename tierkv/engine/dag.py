"""The write-invalidation DAG: which stored objects derive from which.

An edge ``parent -> child`` says that `child` was computed from `parent` (a KV block from the
block before it, every block of a model from the model's version node), so a write of `parent`
(whether or not an old value of it is still stored) or its invalidation must invalidate `child`
and, transitively, everything below it; a plain delete of `parent` leaves `child` alone.
`Dag.remove_subtree` returns that set; the engine does the invalidating.

`Dag` is a pure, synchronous structure: no IO, no locking. The engine owns one and calls it from
the event loop only. A key is a node while it has at least one edge; a key whose last edge goes
is forgotten, so nothing accumulates for keys that left the index.

Cost. `link` is O(1) for the usual shapes (a new block appended to a chain, any key hung under a
version node that has no parents); in general the cycle check expands the descendants of the
child and the ancestors of the parent one node at a time, alternately, and stops when either side
is exhausted, so it costs O(min(descendants(child), ancestors(parent))) nodes, with their edges,
and never depends on the size of the graph. `descendants` and `remove_subtree` cost what they
return (nodes plus their edges). `cut`, `parents`, `children` cost the key's degree; `len`,
`edges` and ``in`` are O(1). Every traversal is iterative: chains of 100k blocks are normal.

Memory. Most nodes are links of a block chain, with one parent and one child, so an adjacency
value is the neighbour's key itself and becomes a `set` only at the second neighbour (and goes
back to the bare key when it drops to one). Keys are shared with the caller, not copied.
Measured with `measure_edge_bytes` (CPython 3.11, 64-bit; the keys themselves excluded, the
index holds them anyway): 105 bytes per edge for a 100k-block chain and 149 for a fan-out-8 tree
of 100k nodes, whose inner nodes hold sets of 8 children (~710 bytes per set). Nearly all of the
chain's cost is the two dicts' tables, so it swings with where their growth stands: 100k
entries sit just past a doubling; 10k blocks measure 59 bytes per edge (tree: 124).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TypeAlias

from tierkv._untracked import untrack
from tierkv.errors import DependencyCycleError

__all__ = ["Dag", "DependencyCycleError", "measure_edge_bytes"]

#: key -> its one neighbour (the common case, no container at all) or a set of two or more
_Adjacency: TypeAlias = dict[bytes, "bytes | set[bytes]"]


# -- compact adjacency: a bare key for one neighbour, a set for two or more ------------------------

def _neighbours(adjacency: _Adjacency, key: bytes) -> Collection[bytes]:
    """The neighbours of `key`, without copying; do not mutate `adjacency` while iterating."""
    value = adjacency.get(key)
    if value is None:
        return ()
    if isinstance(value, bytes):
        return (value,)
    return value


def _has(adjacency: _Adjacency, key: bytes, neighbour: bytes) -> bool:
    value = adjacency.get(key)
    if value is None:
        return False
    if isinstance(value, bytes):
        return value == neighbour
    return neighbour in value


def _add(adjacency: _Adjacency, key: bytes, neighbour: bytes) -> None:
    """Add a neighbour that `key` does not have yet."""
    value = adjacency.get(key)
    if value is None:
        adjacency[key] = neighbour
    elif isinstance(value, bytes):
        pair = {value, neighbour}
        untrack(pair)  # of keys: no cycle passes through it (`tierkv._untracked`)
        adjacency[key] = pair
    else:
        value.add(neighbour)


def _remove(adjacency: _Adjacency, key: bytes, neighbour: bytes) -> None:
    """Remove a neighbour that `key` has; drop the entry when it was the last one."""
    value = adjacency[key]
    if isinstance(value, bytes):
        del adjacency[key]
        return
    value.remove(neighbour)
    if len(value) == 1:
        # back to the bare key: a set of one costs ~200 bytes more than no set
        adjacency[key] = next(iter(value))


def _check_key(key: object) -> None:
    # the adjacency tells one neighbour from several by `isinstance(value, bytes)`, so a str or
    # a tuple stored as a key would be misread as a collection of neighbours
    if not isinstance(key, bytes):
        raise TypeError(f"a DAG key must be bytes, not {type(key).__name__}")


class Dag:
    """Edges ``parent -> child`` between canonical keys, kept acyclic.

    Not thread-safe: the engine calls it from one thread (the event loop). Nothing here does IO
    or knows about tiers; the returned lists say what the caller has to invalidate.
    """

    __slots__ = ("_children", "_edges", "_nodes", "_parents")

    def __init__(self) -> None:
        self._children: _Adjacency = {}
        self._parents: _Adjacency = {}
        self._edges = 0
        self._nodes = 0

    # -- queries ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of nodes: keys with at least one edge."""
        return self._nodes

    def __contains__(self, key: object) -> bool:
        """Whether `key` has at least one edge."""
        return key in self._children or key in self._parents

    def __iter__(self) -> Iterator[bytes]:
        """Every node once, in no particular order (for persisting the DAG and for debugging)."""
        yield from self._children
        for key in self._parents:
            if key not in self._children:
                yield key

    def __repr__(self) -> str:
        return f"Dag(nodes={self._nodes}, edges={self._edges})"

    @property
    def edges(self) -> int:
        """The number of edges."""
        return self._edges

    def parents(self, key: bytes) -> frozenset[bytes]:
        """The keys `key` derives from directly (empty for an unknown key)."""
        return frozenset(_neighbours(self._parents, key))

    def children(self, key: bytes) -> frozenset[bytes]:
        """The keys derived directly from `key` (empty for an unknown key)."""
        return frozenset(_neighbours(self._children, key))

    def has_parents(self, key: bytes) -> bool:
        """Whether anything is linked as `key`'s parent; O(1)."""
        return key in self._parents

    def has_children(self, key: bytes) -> bool:
        """Whether anything derives from `key` directly (an overwrite's cheap first question)."""
        return key in self._children

    def descendants(self, key: bytes) -> list[bytes]:
        """Every key derived from `key`, transitively, each once, in breadth-first order.

        `key` itself is not in the list; an unknown key or a leaf gives ``[]``. A key reachable
        along two paths (a diamond) is listed once, at its shortest distance from `key`.
        Costs the nodes returned plus their edges.
        """
        seen = {key}
        order: list[bytes] = []
        self._visit_children(key, seen, order)
        # `order` doubles as the BFS queue: everything before `at` has been expanded
        at = 0
        while at < len(order):
            self._visit_children(order[at], seen, order)
            at += 1
        return order

    def _visit_children(self, key: bytes, seen: set[bytes], order: list[bytes]) -> None:
        for child in _neighbours(self._children, key):
            if child not in seen:
                seen.add(child)
                order.append(child)

    # -- changes ----------------------------------------------------------------------------------

    def link(self, parent: bytes, child: bytes) -> None:
        """Record that `child` derives from `parent`.

        Idempotent for an existing edge. Raises `DependencyCycleError` (and changes nothing) for
        ``parent == child`` or when `parent` already derives from `child`; `TypeError` for a key
        that is not `bytes`.
        """
        self.link_all((parent,), child)

    def link_all(self, parents: Iterable[bytes], child: bytes) -> None:
        """Record that `child` derives from each of `parents`, all or nothing.

        Every edge is checked before any is added: if one would close a cycle, the DAG is left
        as it was and `DependencyCycleError` names that edge. Existing edges and duplicates in
        `parents` are fine; no parents is a no-op.
        """
        for parent in self._new_parents(parents, child):
            self._attach(parent, child)

    def check_parents(self, parents: Iterable[bytes], child: bytes) -> None:
        """Raise as `link_all` would, changing nothing."""
        self._new_parents(parents, child)

    def _new_parents(self, parents: Iterable[bytes], child: bytes) -> set[bytes]:
        """Those of `parents` not yet linked to `child`, checked (`link_all`)."""
        _check_key(child)
        new = {p for p in parents if not _has(self._parents, child, p)}
        for parent in new:
            _check_key(parent)
        # the new edges all end at `child`, so a cycle through several of them would pass through
        # `child` twice: checking each against the current graph is enough
        closing = self._closing_parent(new, child)
        if closing is not None:
            raise DependencyCycleError(closing, child)
        return new

    def set_parents(self, key: bytes, parents: Iterable[bytes],
                    held: Callable[[bytes], bool] | None = None) -> None:
        """Make `parents` exactly the parents of `key` (a new value of it derives from them):
        the new edges are checked first (`DependencyCycleError`, nothing changed), then the
        edges from parents no longer named are dropped. With `held` (which keys hold an
        object), a dropped parent that holds none and is left without children is released
        up its chain (`unlink_parents`): kept, each such put left a node and an edge behind
        for the engine's life, recorded at every flush, and an invalidation of its parents
        still reached what was linked to it later."""
        wanted = set(parents)
        if wanted:
            self.link_all(wanted, key)
        else:  # most puts name no parents: nothing to check
            _check_key(key)
        if key in self._parents:
            for parent in tuple(_neighbours(self._parents, key)):
                if parent not in wanted:
                    self._detach(parent, key)
                    if held is not None and not held(parent):
                        self.unlink_parents(parent, held)

    def cut(self, key: bytes) -> None:
        """Forget `key` as a node: drop its edges to its parents and to its children.

        For a key whose object left the index and no longer has to cascade. A neighbour left
        without edges is forgotten too. A no-op for an unknown key. Costs the key's degree.
        """
        for parent in tuple(_neighbours(self._parents, key)):
            self._detach(parent, key)
        for child in tuple(_neighbours(self._children, key)):
            self._detach(key, child)

    def unlink_parents(self, key: bytes, held: Callable[[bytes], bool]) -> None:
        """`key`'s object left the cache (`held` says which keys still have one): drop the
        edges into it once nothing derives from it any more. While it has children it keeps
        them and its parents both: what derives from it derives from its ancestors through it,
        and an invalidation of one of them must still reach its children (a chain whose middle
        block left). Its edges to its children stay for as long as they are held (a later write
        of `key` must still invalidate what was derived from its old value). A parent that is
        held by no object and left without children is released in turn, up the chain; a key
        left without edges is forgotten. Costs the edges it drops."""
        pending = [key]
        while pending:
            node = pending.pop()
            if node in self._children:
                continue  # something still derives from it, through it from its parents
            for parent in tuple(_neighbours(self._parents, node)):
                self._detach(parent, node)
                if not held(parent):
                    pending.append(parent)

    def remove_subtree(self, key: bytes) -> list[bytes]:
        """Cut `key` and everything derived from it; return those keys, `key` first.

        The rest of the list is `descendants(key)`, in breadth-first order; `key` is listed
        even when it had no edges, so the caller can invalidate the list as it stands. A key that
        also derives from a key outside the subtree is removed all the same: it derives from
        `key`. Costs what it removes (nodes plus their edges).
        """
        removed = [key, *self.descendants(key)]
        for node in removed:
            self.cut(node)
        return removed

    # -- internals --------------------------------------------------------------------------------

    def _closing_parent(self, parents: Collection[bytes], child: bytes) -> bytes | None:
        """One of `parents` that is `child` or is reachable from `child`, or ``None``.

        Searches forwards from `child` and backwards from `parents` at once, one node per side
        per round, and stops when either side runs out: the cost is bounded by the smaller of
        descendants(child) and ancestors(parents), so hanging a long chain under a root (a model
        version node) or appending to a chain is O(1) whichever end is linked first.
        """
        if child in parents:
            return child
        reached = {child}
        forward = [child]
        # ancestor -> the parent it leads to, to name the edge that would close the cycle
        origin = {parent: parent for parent in parents}
        backward = list(parents)
        while forward and backward:
            node = forward.pop()
            for below in _neighbours(self._children, node):
                if below in origin:
                    return origin[below]
                if below not in reached:
                    reached.add(below)
                    forward.append(below)
            node = backward.pop()
            for above in _neighbours(self._parents, node):
                if above in reached:
                    return origin[node]
                if above not in origin:
                    origin[above] = origin[node]
                    backward.append(above)
        return None

    def _attach(self, parent: bytes, child: bytes) -> None:
        """Add an edge known to be new and acyclic."""
        self._count_new(parent)
        self._count_new(child)
        _add(self._children, parent, child)
        _add(self._parents, child, parent)
        self._edges += 1

    def _detach(self, parent: bytes, child: bytes) -> None:
        """Remove an existing edge; forget either end left without edges."""
        _remove(self._children, parent, child)
        _remove(self._parents, child, parent)
        self._edges -= 1
        self._count_gone(parent)
        self._count_gone(child)

    def _count_new(self, key: bytes) -> None:
        if key not in self:
            self._nodes += 1

    def _count_gone(self, key: bytes) -> None:
        if key not in self:
            self._nodes -= 1


def measure_edge_bytes(n: int = 100_000, fanout: int = 1) -> float:
    """Bytes of Python heap per edge of a `Dag` of `n` nodes, measured with `tracemalloc`.

    ``fanout=1`` builds one chain of `n` blocks (``n - 1`` edges); a larger `fanout` builds a
    tree where node ``i`` derives from node ``(i - 1) // fanout``. The keys (32 bytes each, the
    size of a hashed block key) are made before the measurement starts: the engine's index owns
    them, the DAG only refers to them. Works whether or not `tracemalloc` is already tracing.
    For the numbers in the docs; it takes a second or so for the default `n`.
    """
    if n < 2 or fanout < 1:
        raise ValueError("measure_edge_bytes needs n >= 2 and fanout >= 1")
    keys = [i.to_bytes(8, "big") * 4 for i in range(n)]
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        dag = Dag()
        for i in range(1, n):
            dag.link(keys[(i - 1) // fanout], keys[i])
        after, _ = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
    return (after - before) / dag.edges
