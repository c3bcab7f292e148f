"""`add_dependency(parent, child)` rewrites the child's persistent copies with a header naming
the new parent, so that the edge survives a restart. A rewrite into a full pool fails (it
allocates the new record before it frees the old one); the engine used to keep the edge in
memory only and the copy with the old header on media: after a restart a new value of the
parent left the child readable, stale. The copies without the edge are now removed."""

from __future__ import annotations

from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config

pytestmark = pytest.mark.pmem


async def test_an_edge_the_full_pool_cannot_take_never_leaves_a_stale_child(tmp_path: Path
                                                                          ) -> None:
    config = hierarchy_config(tmp_path, ("pmem",))
    async with tierkv.open(config) as kv:
        await kv.put("parent", b"P1" * 1000)
        await kv.put("child", b"C" * (2 * MiB))
        for i in range(30):  # fill the pool, keeping the two hot (LRU++ keeps them)
            await kv.put(f"filler-{i}", b"F" * (300 * KiB))
            await kv.get("child")
            await kv.get("parent")
        await kv.settle()
        assert await kv.contains("child")
        await kv.add_dependency("parent", "child")
        assert kv.stats()["engine"]["dag_edges_unpersisted"] == 1, \
            "the rewrite found room: the test lost its point"
    async with tierkv.open(config) as kv:
        await kv.put("parent", b"P2" * 1000)
        assert await kv.get("child") is None
