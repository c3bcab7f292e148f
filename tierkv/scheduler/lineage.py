"""Prefix chains of the cached keys: each key's parent, its depth, and whether it is orphaned.

A KV block is only usable by a prefix lookup while every block before it is cached, so a block
whose parent is in no tier is worth nothing and goes first, and within a chain the deepest block
goes before its ancestors (leaf-first, as a radix cache evicts). Parents come from
``put(..., parents=...)`` and from `put_many` of a `block_keys` chain; the first parent names
the prefix (the chain a block extends).

Only keys held in some tier are tracked (`enter` / `leave`), and a parent's entry lives as long
as it is held or has held children, so memory follows the cache, not its history. Each change
returns the keys whose standing changed (became orphans or were adopted again), for the
policies to re-rank: cost proportional to the children touched.
"""

from __future__ import annotations

from tierkv._untracked import untrack


class _Node:
    __slots__ = ("children", "depth", "held", "parent")

    def __init__(self) -> None:
        self.parent: bytes | None = None
        self.depth = 0
        self.held = False
        #: made on the first child (most blocks are leaves: a set each cost 200 bytes)
        self.children: set[bytes] | None = None
        untrack(self)  # atoms only: no cycle can pass through it (`tierkv._untracked`)


class Lineage:
    def __init__(self) -> None:
        self._nodes: dict[bytes, _Node] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def children(self, key: bytes) -> list[bytes]:
        """The held or known blocks extending `key`."""
        node = self._nodes.get(key)
        return list(node.children) if node is not None and node.children else []

    def enter(self, key: bytes, parent: bytes | None) -> tuple[list[bytes], int, bool]:
        """`key` is now held, extending `parent` (or no chain); returns its children that had
        been orphaned by its absence and are adopted again, its depth and whether it is an
        orphan itself (its parent is held nowhere)."""
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = _Node()
        if parent is not None and parent not in (key, node.parent):
            self._unlink(key, node)
            above = self._nodes.get(parent)
            if above is None:
                above = self._nodes[parent] = _Node()
            if above.children is None:
                above.children = set()
                untrack(above.children)  # of keys: no cycle passes through it
            above.children.add(key)
            node.parent, node.depth = parent, above.depth + 1
        node.held = True
        above = self._nodes.get(node.parent) if node.parent is not None else None
        orphan = node.parent is not None and (above is None or not above.held)
        return (list(node.children) if node.children else []), node.depth, orphan

    def leave(self, key: bytes) -> list[bytes]:
        """`key` is no longer held; returns its children, orphaned now."""
        node = self._nodes.get(key)
        if node is None:
            return []
        node.held = False
        children = list(node.children) if node.children else []
        self._unlink(key, node)
        if not children:
            del self._nodes[key]
        return children

    def _unlink(self, key: bytes, node: _Node) -> None:
        parent_key = node.parent
        if parent_key is None:
            return
        node.parent = None
        above = self._nodes.get(parent_key)
        if above is None:
            return
        if above.children is not None:
            above.children.discard(key)
        if not above.children and not above.held:
            del self._nodes[parent_key]
