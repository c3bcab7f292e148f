"""What the engine leaves for Python's cyclic garbage collector to walk.

A full collection walks every tracked object on the event loop; the engine's per-object records
(index entry, meta, locations, score, lineage node, tier records, the DAG's parent sets, the
nvme index's interned metadata) are kept out of its sight, so the pause no longer grows with
the cache (docs/architecture.md, "Python's garbage collector"). Reference counting still frees
them: a cache filled and emptied again holds no more memory the second time than the first.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config
from tierkv import Engine, block_keys

pytestmark = pytest.mark.pmem

CHAINS, BLOCKS = 60, 50  # 3,000 blocks of 4 KiB (12 MiB): through gpu and pool into the log


def _config(tmp_path: Path) -> dict[str, object]:
    return hierarchy_config(tmp_path, ("gpu", "pmem", "nvme"),
                            gpu={"capacity": 256 * KiB, "slot_size": 4 * KiB, "ttl": "1h"},
                            pmem={"capacity": 8 * MiB},
                            nvme={"capacity": 64 * MiB, "region_size": MiB})


async def _fill(kv: Engine, value: bytes) -> list[tierkv.BlockKey]:
    keys: list[tierkv.BlockKey] = []
    for chain in range(CHAINS):
        tokens = list(range(chain * 10_000, chain * 10_000 + 16 * BLOCKS))
        blocks = block_keys(tokens, block_size=16, model="m@1", rope_theta=1e4)
        await kv.put_many([(key, value) for key in blocks])
        keys += blocks
    await kv.settle()
    return keys


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


async def test_cached_objects_add_nothing_for_the_collector_to_walk(tmp_path: Path) -> None:
    value = os.urandom(4 * KiB)
    async with tierkv.open(_config(tmp_path)) as kv:
        before = _tracked()
        keys = await _fill(kv, value)
        # not the engine's: the keys this test holds (and their list)
        grown = _tracked() - before - sum(map(gc.is_tracked, keys)) - 1
        where = [await kv.locate(key) for key in keys]
        assert {"gpu", "pmem", "nvme"} <= set(where)  # every tier's records are counted
        # about 6.5 tracked objects a cached object before; what is left is the loop's
        assert grown < 0.1 * len(keys), grown
        assert [await kv.get(key) for key in keys[::97]] == [value] * len(keys[::97])
    async with tierkv.open(_config(tmp_path)) as reopened:
        # recovery makes the same records: none tracked either
        assert reopened.stats()["engine"]["objects"] == len(keys)
        # (and a few hundred objects the reopen keeps whatever the cache holds: ctypes
        # functions, bound methods)
        held_by_test = sum(map(gc.is_tracked, keys)) + 1
        assert _tracked() - before - held_by_test < 0.25 * len(keys)


async def test_records_out_of_sight_are_still_freed(tmp_path: Path) -> None:
    value = os.urandom(4 * KiB)
    async with tierkv.open(_config(tmp_path)) as kv:
        held: list[int] = []
        tracemalloc.start()
        try:
            for _round in range(3):
                keys = await _fill(kv, value)
                for key in keys:
                    await kv.delete(key)
                await kv.settle()
                del keys
                gc.collect()
                held.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
        assert kv.stats()["engine"]["objects"] == 0
    # the first round sizes the tables (dicts keep their size); later rounds hold no more: a
    # record leaked each round would add some 3,000 times ~1 KiB
    assert held[2] < held[1] + 256 * KiB, held
