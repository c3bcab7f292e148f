"""The gpu tier's large copies on the CPU, run on the native library's workers (puts, and gets of
tensors): the bytes, the slots a cancelled put or get leaves, and a key deleted while its get's
copy still runs."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
import torch

from tierkv.config import GpuTierConfig, HostCopies
from tierkv.errors import TierFullError
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.gpu._host_copies import (
    BUSY_ENOUGH,
    NATIVE_COPY_MIN,
    PROBE_INTERVAL,
    WEIGHT,
    LoopOverlap,
)
from tierkv.tiers.gpu.tier import GpuTier

pytestmark = pytest.mark.native

SLOT = 1 << 20
LARGE = SLOT  # at or above NATIVE_COPY_MIN: copied on a worker
assert LARGE >= NATIVE_COPY_MIN


def meta(n: int, kind: ValueKind = ValueKind.BYTES) -> ObjectMeta:
    return ObjectMeta(kind, "uint8" if kind is ValueKind.TENSOR else "",
                      (n,) if kind is ValueKind.TENSOR else (), n, 1)


async def opened(slots: int, mode: HostCopies = HostCopies.WORKERS) -> GpuTier:
    gpu = GpuTier(GpuTierConfig("l1", slots * SLOT, "cpu", SLOT, 5.0, host_copies=mode))
    await gpu.open()
    assert gpu.stats()["copy_path"].startswith("native workers")
    return gpu


async def round_trip(gpu: GpuTier, key: bytes) -> None:
    """A large bytes value put into `gpu` comes back equal."""
    value = os.urandom(LARGE)
    await gpu.put(key, meta(LARGE), memoryview(value))
    got = await gpu.get(key)
    assert got is not None and got[1] == value


async def until_empty(gpu: GpuTier) -> None:
    """Wait (briefly) for the workers' copies to end and give their slots back."""
    for _ in range(100):
        if gpu.used == 0:
            break
        await asyncio.sleep(0.001)
    assert gpu.used == 0


@pytest.fixture
async def tier() -> AsyncIterator[GpuTier]:
    gpu = await opened(8)
    yield gpu
    await gpu.close()


async def test_large_objects_round_trip_through_the_workers(tier: GpuTier) -> None:
    values = {b"k%d" % i: os.urandom(LARGE - i) for i in range(8)}
    await asyncio.gather(*(tier.put(k, meta(len(v)), memoryview(v)) for k, v in values.items()))
    got = await asyncio.gather(*(tier.get(k) for k in values))
    for (key, value), result in zip(values.items(), got, strict=True):
        assert result is not None, key
        assert type(result[1]) is bytes and result[1] == value


async def test_a_large_tensor_comes_back_as_a_tensor(tier: GpuTier) -> None:
    value = torch.randint(0, 256, (LARGE,), dtype=torch.uint8)
    await tier.put(b"t", meta(LARGE, ValueKind.TENSOR), value)
    got = await tier.get(b"t")
    assert got is not None and isinstance(got[1], torch.Tensor)
    assert torch.equal(got[1], value)


async def test_a_cancelled_put_gives_its_slots_back_and_stores_nothing() -> None:
    gpu = await opened(1)
    try:
        put = asyncio.ensure_future(gpu.put(b"p", meta(LARGE), memoryview(os.urandom(LARGE))))
        await asyncio.sleep(0)  # the copy is submitted
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert await gpu.get(b"p") is None
        await until_empty(gpu)  # the slot comes back when the worker's copy has ended
        await round_trip(gpu, b"q")
    finally:
        await gpu.close()


async def test_a_key_deleted_during_its_get_keeps_its_slots_until_the_copy_ends() -> None:
    gpu = await opened(1)
    try:
        value = torch.randint(0, 256, (LARGE,), dtype=torch.uint8)
        await gpu.put(b"a", meta(LARGE, ValueKind.TENSOR), value)
        get = asyncio.ensure_future(gpu.get(b"a"))
        await asyncio.sleep(0)  # the copy out is submitted; its end is reaped on the loop later
        assert await gpu.delete(b"a")
        with pytest.raises(TierFullError):  # the only slot is still being read
            await gpu.put(b"b", meta(LARGE), memoryview(bytes(LARGE)))
        got = await get
        assert got is not None and isinstance(got[1], torch.Tensor)
        assert torch.equal(got[1], value)
        assert gpu.used == 0
        await gpu.put(b"b", meta(LARGE), memoryview(bytes(LARGE)))
    finally:
        await gpu.close()


async def test_a_cancelled_get_leaves_nothing_reserved() -> None:
    gpu = await opened(1)
    try:
        await gpu.put(b"a", meta(LARGE, ValueKind.TENSOR),
                      torch.zeros(LARGE, dtype=torch.uint8))
        get = asyncio.ensure_future(gpu.get(b"a"))
        await asyncio.sleep(0)
        get.cancel()
        with pytest.raises(asyncio.CancelledError):
            await get
        await gpu.delete(b"a")
        await until_empty(gpu)
    finally:
        await gpu.close()


async def test_close_waits_for_a_cancelled_callers_copy() -> None:
    gpu = await opened(2)
    put = asyncio.ensure_future(gpu.put(b"p", meta(LARGE), memoryview(os.urandom(LARGE))))
    await asyncio.sleep(0)
    put.cancel()
    await gpu.close()  # returns once the worker has let go of the pool's memory
    assert put.cancelled()


async def test_auto_keeps_a_lone_callers_copies_inline() -> None:
    gpu = await opened(8, HostCopies.AUTO)
    try:
        value = os.urandom(LARGE)
        for i in range(8):  # one caller, one object after another: the loop waits idle
            await gpu.put(b"k%d" % (i % 2), meta(LARGE), memoryview(value))
        assert "now off" in gpu.stats()["copy_path"]
        await gpu.put(b"inline", meta(LARGE), memoryview(value))
        got = await gpu.get(b"inline")
        assert got is not None and got[1] == value
    finally:
        await gpu.close()


# The gauge's rule, fed measurements directly: what a real loop measures depends on how much
# CPU the machine gives it (a busy loop that other processes keep off its CPU reads as half
# idle), so a test through a real loop would test the machine's load.


def test_the_gauge_offloads_until_a_loop_is_measured_idle() -> None:
    gauge = LoopOverlap()
    assert gauge.offload()
    gauge.measured(0.0, 1.0)  # a copy alone now and then, the last of a burst: still busy
    assert gauge.busy >= BUSY_ENOUGH and gauge.offload()
    for _ in range(4 * WEIGHT):  # a lone caller: its hand-off keeps the loop about half busy
        gauge.measured(0.45, 1.0)
    assert gauge.busy < BUSY_ENOUGH


async def test_the_gauge_probes_once_an_interval_and_takes_a_probes_measure_as_it_is() -> None:
    gauge = LoopOverlap()
    for _ in range(4 * WEIGHT):
        gauge.measured(0.45, 1.0)
    assert gauge.offload()  # the first probe is due at once
    assert not gauge.offload()  # the next one only after the interval
    gauge.measured(0.3, 1.0)
    assert gauge.busy == pytest.approx(0.3)
    await asyncio.sleep(PROBE_INTERVAL * 1.5)
    assert gauge.offload()
    gauge.measured(1.0, 1.0)  # the loop got busy: the workers at once
    assert gauge.busy == 1.0 and gauge.offload() and gauge.offload()


async def test_inline_never_starts_workers() -> None:
    gpu = GpuTier(GpuTierConfig("l1", 2 * SLOT, "cpu", SLOT, 5.0,
                                host_copies=HostCopies.INLINE))
    await gpu.open()
    try:
        assert gpu.stats()["copy_path"] == "inline"
        await round_trip(gpu, b"a")
    finally:
        await gpu.close()


async def test_a_payload_shorter_than_its_meta_is_refused_and_frees_its_slots(
        tier: GpuTier) -> None:
    with pytest.raises(ValueError, match="payload of"):
        await tier.put(b"short", meta(LARGE), memoryview(bytes(LARGE - 1)))
    assert tier.used == 0
    assert await tier.get(b"short") is None
