"""A child put while its parent's first value is being stored (it names the key as its
parent, and returns before the parent's put does) is removed by that put before it returns,
as it is when the parent had an older value: a write removes what derives from the key, even
at its first write. The put decided whether to look once, before the store, and a key with no
value and no children then kept the children linked meanwhile."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import hierarchy_config

pytestmark = pytest.mark.pmem


async def child_inside_parent_put(kv: tierkv.Engine, i: int) -> tuple[bool, bool]:
    """Whether the child's put began after the parent's and ended before it, and whether the
    child is still there once the parent's put returned."""
    parent, child = f"r{i}", f"r{i}/c"
    spans: dict[str, tuple[float, float]] = {}

    async def put(name: str, key: str, value: bytes, parents: list[str] | None) -> None:
        if parents:
            await asyncio.sleep(0)  # after the parent's put began
        began = time.perf_counter()
        await kv.put(key, value, parents=parents or ())
        spans[name] = (began, time.perf_counter())

    await asyncio.gather(put("parent", parent, b"P" * (900 << 10), None),
                         put("child", child, b"child", [parent]))
    inside = spans["parent"][0] < spans["child"][0] and spans["child"][1] < spans["parent"][1]
    return inside, await kv.get(child) is not None


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
async def test_a_child_put_during_the_parents_first_put_goes(tmp_path: Path, policy: str) -> None:
    config = hierarchy_config(tmp_path, ("gpu", "pmem"), write_policy=policy,
                              gpu={"capacity": 4 << 20, "slot_size": 64 << 10})
    inside = 0
    async with tierkv.open(config) as kv:
        for i in range(200):
            was_inside, survived = await child_inside_parent_put(kv, i)
            if was_inside:
                inside += 1
                assert not survived, f"trial {i}: the child outlived its parent's first put"
                if inside >= 10:
                    break
    assert inside  # the race was run
