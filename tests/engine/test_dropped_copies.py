"""A copy the nvme log let go of because a read found it corrupt stays on media until its region
is reused: a later scan of the log (after a crash, or a close whose checkpoint write failed) must
not bring it back. A fault soak found a deleted value served again after a clean close: the read
had dropped the object (a bit flipped on the way from the device), so the delete of its key found
nothing to delete, and the close's checkpoint write was torn, so the next open scanned."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import KiB, hierarchy_config
from tierkv.testing.faults import FaultPlan, open_with_faults

VALUE = bytes(range(256)) * (64 * KiB // 256)


async def test_a_copy_dropped_as_corrupt_never_comes_back_after_a_delete(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)  # the injected faults are logged as warnings
    config = hierarchy_config(tmp_path, ("nvme",))
    async with tierkv.open(config) as kv:  # the object goes to the device (read back from it)
        await kv.put("k", VALUE)
    plan = FaultPlan.parse("nvme:flip=1;ops=get,nvme:torn=1;ops=put", seed=1)
    plan.enabled = False
    kv = await open_with_faults(config, plan)
    closed = False
    try:
        plan.enabled = True  # every device read flips a bit: until one lands in the entry
        for _ in range(200):
            if await kv.get("k") is None:
                break
        plan.enabled = False
        assert await kv.get("k") is None, "no flipped bit landed in the entry"
        assert await kv.delete("k") is False  # the engine holds nothing of it any more
        await kv.flush()  # the delete is durable from here on
        plan.enabled = True  # the close's checkpoint write is torn: the next open scans
        await kv.close()
        closed = True
    finally:
        plan.enabled = False
        if not closed:
            await kv.close()
    async with tierkv.open(config) as kv:
        assert kv.stats()["tiers"]["nvme"]["recovered_from"] == "scan"
        assert await kv.get("k") is None
