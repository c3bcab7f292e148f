"""A demotion whose write fails must not keep the first tier's slots taken, nor be retried in
a busy loop. The move copies
from a view the gpu tier lends over the slot (freed once the last view is gone); the error's
traceback held the frames holding that view, and a local holding the error made a cycle, so
the slots stayed taken until Python's full collection ran: with them all taken, puts skipped
the first tier. The test runs with the cyclic collector off, so that only reference counting
frees what it must."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine._configs import KiB, hierarchy_config
from tierkv.errors import TierKVError
from tierkv.testing.faults import FaultPlan, open_with_faults

pytestmark = pytest.mark.pmem


@pytest.fixture
def no_cyclic_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_cyclic_collection")
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
async def test_slots_a_failed_demotion_copied_from_are_freed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str) -> None:
    caplog.set_level(logging.CRITICAL)  # the injected faults are logged
    config = hierarchy_config(tmp_path, ("gpu", "pmem"), write_policy=policy,
                              gpu={"capacity": 256 * KiB, "slot_size": 64 * KiB})
    config["engine"]["space_timeout"] = "200ms"  # puts wait for room that never comes
    plan = FaultPlan.parse("pmem:eio=1;ops=put|flush", seed=1)
    plan.enabled = False
    kv = await open_with_faults(config, plan)
    try:
        plan.enabled = True
        for i in range(8):
            with contextlib.suppress(TierKVError):  # a write-through put fails with its pool
                await kv.put(f"k{i}", bytes([i]) * (48 * KiB))
        with contextlib.suppress(TierKVError):  # the pool refuses every write
            await kv.flush()
        await kv.settle()
        assert plan.fired["pmem:eio"] > 0
        if policy == "write_back":  # write-through puts fail with the pool: nothing to move
            # failed moves are retried after a growing pause: retried at once, the evictor took
            # a CPU whole, tens of thousands of failed moves a second
            assert 0 < kv.stats()["engine"]["moves_failed"] < 1000
        plan.enabled = False
        for i in range(8):
            await kv.delete(f"k{i}")
        await kv.settle()
        gpu = kv.stats()["tiers"]["gpu"]
        assert (gpu["objects"], gpu["used"]) == (0, 0)
        await kv.put("after", b"x" * 1000)
        assert await kv.locate("after") == "gpu"
    finally:
        await kv.close()
