"""A chain put while another engine's invalidation of it is applied here stays one chain.

Engine B invalidates a model version while engine A puts a chain of that version again
(`put_many`). A's follower applies B's invalidation one key at a time, between and during A's
puts: it removed A's new second block and cut it from the first, and A's later blocks, linked
to the second alone, then outlived A's own new value of the first block, on both engines. A
block is now stored only while its parent block holds the value the call put
(`_items.put_chains`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import tierkv
from tests.engine._configs import KiB, MiB, gpu_tier, pmem_tier
from tests.engine.test_shared_engine import engines

pytestmark = [pytest.mark.redis, pytest.mark.pmem]

BLOCKS, SIZE = 5, 40 * KiB


def config(directory: Path, url: str) -> dict[str, Any]:
    """A small first tier over a pool, as an inference server's: puts wait for its evictor."""
    directory.mkdir(parents=True, exist_ok=True)
    return {"tiers": [gpu_tier(capacity=512 * KiB, ttl="1s"), pmem_tier(directory),
                      {"name": "shared", "kind": "redis", "url": url, "capacity": 64 * MiB}]}


def value(i: int) -> bytes:
    return i.to_bytes(4, "little") * (SIZE // 4)


@pytest.mark.parametrize("run", range(4))
async def test_a_chain_put_during_a_remote_invalidation_goes_with_its_first_block(
        redis_url: str, tmp_path: Path, run: int) -> None:
    del run  # the interleaving varies from run to run; every run must hold
    async with engines(config(tmp_path / "a", redis_url), config(tmp_path / "b", redis_url)
                       ) as (a, b):
        keys = tierkv.block_keys(list(range(4 * BLOCKS)), block_size=4, model="m@1",
                                 rope_theta=1.0)
        await a.put_many((key, value(i)) for i, key in enumerate(keys))
        await a.settle()
        assert None not in await b.get_many(keys)  # B knows the chain: its entry names it
        assert await b.invalidate_model("m@1") == BLOCKS
        await a.get_many(keys)  # A serves them still: its follower has not read B's entry
        await a.put_many((key, value(100 + i)) for i, key in enumerate(keys))
        await a.put(keys[0], value(200))  # a new value of the first block: the rest derive
        await asyncio.sleep(0.5)  # the followers catch up
        for kv in (a, b):
            assert await kv.get_many(keys[1:]) == [None] * (BLOCKS - 1)
