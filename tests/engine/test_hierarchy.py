"""The engine over real tier hierarchies: gpu → nvme, gpu → pmem → nvme.

Demotion of what L1 evicts, hits in lower tiers, flush and warm restart, write-through,
invalidation that a restart does not undo, and a state machine over the whole hierarchy.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import rule

import tierkv
from tests.engine.test_engine_state_machine import KEYS, ModelMachine, same
from tierkv.errors import TierFullError


def hierarchy(
    tmp: Path, *, pmem: bool = True, write_policy: str = "write_back", gpu_capacity: str = "16KiB"
) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {
            "name": "gpu",
            "kind": "gpu",
            "device": "cpu",
            "capacity": gpu_capacity,
            "slot_size": "4KiB",
            "ttl": "60s",
        },
    ]
    if pmem:
        tiers.append(
            {"name": "pmem", "kind": "pmem", "path": str(tmp / "tierkv.pool"), "capacity": "16MiB"}
        )
    tiers.append(
        {
            "name": "nvme",
            "kind": "nvme",
            "path": str(tmp / "tierkv.log"),
            "capacity": "8MiB",
            "region_size": "1MiB",
            "queue_depth": 8,
        }
    )
    return {"engine": {"write_policy": write_policy}, "tiers": tiers}


@pytest.mark.parametrize("with_pmem", [pytest.param(False, id="gpu-nvme"),
                                       pytest.param(True, id="gpu-pmem-nvme",
                                                    marks=pytest.mark.pmem)])
async def test_l1_evictions_are_demoted_and_served_below(tmp_path: Path, with_pmem: bool) -> None:
    values = {f"k{i}": os.urandom(3000) for i in range(12)}
    async with tierkv.open(hierarchy(tmp_path, pmem=with_pmem)) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        below = "pmem" if with_pmem else "nvme"
        assert await kv.locate("k0") == below
        assert await kv.locate("k11") == "gpu"
        for key, value in values.items():
            assert await kv.get(key) == value
        stats = kv.stats()["engine"]
        assert stats["demotions"].get(below, 0) >= 8
        assert stats["hits"].get(below, 0) >= 8


@pytest.mark.pmem
async def test_chain_demotes_from_pmem_to_nvme(tmp_path: Path) -> None:
    config = hierarchy(tmp_path)
    config["tiers"][1]["capacity"] = "8MiB"  # the smallest pool PMDK accepts
    config["tiers"][2]["capacity"] = "32MiB"
    async with tierkv.open(config) as kv:
        big = [os.urandom(600 << 10) for _ in range(20)]
        for i, value in enumerate(big):
            await kv.put(f"big{i}", value)
        assert await kv.locate("big0") == "nvme"
        for i, value in enumerate(big):
            assert await kv.get(f"big{i}") == value


@pytest.mark.pmem
async def test_clean_close_and_reopen_is_warm(tmp_path: Path) -> None:
    values = {f"k{i}": os.urandom(2000 + i) for i in range(20)}
    tensor = torch.randn(64, 8)
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        await kv.put("tensor", tensor)
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        for key, value in values.items():
            assert await kv.get(key) == value
        got = await kv.get("tensor")
        assert isinstance(got, torch.Tensor) and torch.equal(got, tensor)
        assert await kv.locate("k19") in ("pmem", "nvme")


@pytest.mark.pmem
async def test_flush_is_a_barrier(tmp_path: Path) -> None:
    async with tierkv.open(hierarchy(tmp_path, gpu_capacity="1MiB")) as kv:
        await kv.put("k", b"durable")
        assert await kv.locate("k") == "gpu"
        await kv.flush()
        stats = kv.stats()["tiers"]
        assert stats["pmem"]["used"] > 0
        assert await kv.locate("k") == "gpu"  # still hot in L1, now with a durable copy


@pytest.mark.pmem
async def test_unflushed_counts_objects_without_a_persistent_copy(tmp_path: Path) -> None:
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        for i in range(3):
            await kv.put(f"k{i}", bytes(3000))
        assert kv.stats()["engine"]["unflushed"] == 3
        for i in range(3, 8):  # four slots: the oldest are demoted to pmem
            await kv.put(f"k{i}", bytes(3000))
        assert kv.stats()["engine"]["unflushed"] == 4
        await kv.delete("k7")
        assert kv.stats()["engine"]["unflushed"] == 3
        await kv.flush()
        assert kv.stats()["engine"]["unflushed"] == 0
        await kv.put("k0", b"rewritten")
        assert kv.stats()["engine"]["unflushed"] == 1


@pytest.mark.pmem
async def test_write_through_puts_a_persistent_copy(tmp_path: Path) -> None:
    async with tierkv.open(
        hierarchy(tmp_path, write_policy="write_through", gpu_capacity="1MiB")
    ) as kv:
        await kv.put("k", b"v" * 100)
        assert kv.stats()["tiers"]["pmem"]["used"] > 0
        assert await kv.get("k") == b"v" * 100


async def test_write_through_refuses_what_no_persistent_tier_can_hold(tmp_path: Path) -> None:
    """An object larger than the log's 1 MiB region fits the gpu tier alone: a write-through
    put of it is refused before anything changes (acknowledged, it was in volatile memory only
    and a crash lost it), and the key keeps its old, durable value across a reopen."""
    config = hierarchy(tmp_path, pmem=False, write_policy="write_through", gpu_capacity="4MiB")
    async with tierkv.open(config) as kv:
        await kv.put("k", b"old")
        with pytest.raises(TierFullError, match=r"no persistent tier \('nvme'\) can hold"):
            await kv.put("k", os.urandom(1 << 20))
        with pytest.raises(TierFullError):
            await kv.put("big", os.urandom(1 << 20))
        assert await kv.get("k") == b"old"
        assert await kv.get("big") is None
        assert kv.stats()["engine"]["unflushed"] == 0
    async with tierkv.open(config) as kv:
        assert await kv.get("k") == b"old"
    config["engine"]["write_policy"] = "write_back"  # no promise of durability before a flush
    async with tierkv.open(config) as kv:
        await kv.put("big", big := os.urandom(1 << 20))
        assert await kv.get("big") == big


@pytest.mark.pmem
async def test_invalidated_objects_stay_gone_after_restart(tmp_path: Path) -> None:
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        for i in range(10):
            await kv.put(f"k{i}", os.urandom(3000))
        await kv.flush()
        assert await kv.invalidate("k0") == 1
        assert await kv.invalidate("k9") == 1
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        assert await kv.get("k0") is None
        assert await kv.get("k9") is None
        assert await kv.get("k5") is not None


@pytest.mark.pmem
async def test_rewrite_after_flush_keeps_only_the_new_value(tmp_path: Path) -> None:
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        await kv.put("k", b"old" * 1000)
        await kv.flush()
        await kv.put("k", b"new" * 1000)
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        assert await kv.get("k") == b"new" * 1000


@pytest.mark.pmem
async def test_pin_promotes_from_a_lower_tier(tmp_path: Path) -> None:
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        await kv.put("p", torch.arange(100, dtype=torch.int64))
        for i in range(8):
            await kv.put(f"f{i}", bytes(4096))
        assert await kv.locate("p") != "gpu"
        async with kv.pin("p") as handle:
            assert await kv.locate("p") == "gpu"
            assert torch.equal(handle.value, torch.arange(100, dtype=torch.int64))


@pytest.mark.pmem
async def test_concurrent_gets_across_tiers(tmp_path: Path) -> None:
    values = {f"k{i}": os.urandom(3500) for i in range(24)}
    async with tierkv.open(hierarchy(tmp_path)) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        results = await asyncio.gather(*(kv.get(k) for k in values))
        assert results == list(values.values())
        assert await kv.get_many(list(values)) == list(values.values())


class HierarchyMachine(ModelMachine):
    """The dictionary-model state machine over gpu → pmem → nvme, with restarts."""

    def make_config(self) -> dict[str, Any]:
        self.directory = tempfile.TemporaryDirectory(prefix="tierkv-sm-")
        config = hierarchy(Path(self.directory.name), gpu_capacity="4KiB")
        config["tiers"][0]["slot_size"] = "512B"
        return config

    @rule(key=KEYS)
    def get(self, key: str | bytes) -> None:
        got = self.run(self.kv.get(key))
        if key in self.model:
            # nothing is dropped: the hierarchy is far larger than the key space
            assert got is not None and same(got, self.model[key])
        else:
            assert got is None

    @rule(key=KEYS)
    def invalidate(self, key: str | bytes) -> None:
        removed = self.run(self.kv.invalidate(key))
        assert removed == (1 if key in self.model else 0)
        self.model.pop(key, None)

    @rule()
    def flush(self) -> None:
        self.run(self.kv.flush())

    @rule()
    def restart(self) -> None:
        self.run(self.kv.close())
        self.kv = self.run(tierkv.open(self.config))

    def teardown(self) -> None:
        super().teardown()
        self.directory.cleanup()


TestHierarchyMachine = pytest.mark.pmem(HierarchyMachine.TestCase)
TestHierarchyMachine.settings = settings(
    max_examples=15,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
