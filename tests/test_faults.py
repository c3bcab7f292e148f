"""Fault injection itself (`tierkv.testing.faults`): the plan's text form, what fires when, and
that the injected faults are the real thing — a flipped bit really reaches the nvme tier's
checksum, a torn write really leaves half a write on media — before the engine's guarantees
are tested on top of them (tests/engine/test_fault_guarantees.py).
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from tests.tiers._nvme_support import BLOCK, entry_bytes, key, meta_of, nvme_config, payload_for
from tierkv.config import GpuTierConfig
from tierkv.errors import ConfigError, DeviceError
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.testing import payload_bytes
from tierkv.testing.faults import (
    DEVICE_FAULTS,
    TIER_FAULTS,
    Fault,
    FaultPlan,
    FaultyBlockIO,
    faulty,
    open_with_faults,
)
from tierkv.tiers.base import Tier
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.nvme.tier import NvmeTier


# -- the text form -------------------------------------------------------------------------------
def _shape(fault: Fault) -> tuple[str, str, float, float, frozenset[str]]:
    return fault.tier, fault.kind, fault.rate, fault.arg, fault.ops


@pytest.mark.parametrize(("spec", "expected"), [
    ("pmem:eio=0.05", [("pmem", "eio", 0.05, 0.0, frozenset())]),
    ("nvme:latency=0.2@50ms", [("nvme", "latency", 0.2, 0.05, frozenset())]),
    ("redis:hang=0.001;ops=get", [("redis", "hang", 0.001, 0.0, frozenset({"get"}))]),
    ("nvme:eio=1;ops=get|put", [("nvme", "eio", 1.0, 0.0, frozenset({"get", "put"}))]),
    (" pmem:enospc=0 , ,nvme:torn=0.5,nvme:flip=1 ",
     [("pmem", "enospc", 0.0, 0.0, frozenset()), ("nvme", "torn", 0.5, 0.0, frozenset()),
      ("nvme", "flip", 1.0, 0.0, frozenset())]),
    ("", []),
])
def test_parse_reads_each_part(spec: str, expected: list[tuple[Any, ...]]) -> None:
    plan = FaultPlan.parse(spec, seed=3)
    assert [_shape(fault) for fault in plan.faults] == expected
    assert plan.seed == 3 and plan.enabled and not plan.fired


@pytest.mark.parametrize("bad", [
    "pmem",  # no fault
    "pmem:eio",  # no rate
    ":eio=0.1",  # no tier
    "pmem:melt=0.1",  # no such fault
    "pmem:eio=often",
    "pmem:eio=1.5",
    "pmem:eio=-0.1",
    "pmem:eio=nan",
    "nvme:latency=0.2",  # a latency without its duration
    "nvme:latency=0.2@soon",
    "nvme:eio=0.1;ops=read",
    "nvme:eio=0.1;op=get",
    "nvme:eio=0.1;ops=",
])
def test_parse_names_the_bad_part(bad: str) -> None:
    with pytest.raises(ConfigError) as caught:
        FaultPlan.parse(f"pmem:eio=0.1,{bad},nvme:flip=0.01")
    assert repr(bad) in str(caught.value)  # the part is named, not its good neighbours
    assert "pmem:eio=0.1'" not in str(caught.value)


# -- what fires ----------------------------------------------------------------------------------
def _draws(plan: FaultPlan, calls: int, tier: str = "t", op: str = "get",
           kinds: tuple[str, ...] = TIER_FAULTS) -> list[int]:
    """The call numbers (1-based) at which a fault fired."""
    return [n for n in range(1, calls + 1) if plan.draw(tier, op, kinds) is not None]


def test_a_schedule_fires_on_its_call_numbers_only() -> None:
    plan = FaultPlan().add("t", "eio", schedule=[2, 5])
    assert _draws(plan, 10) == [2, 5]
    assert plan.fired == {"t:eio": 2}
    assert plan.faults[0].calls == 10


def test_a_rate_fires_on_that_share_of_calls() -> None:
    assert _draws(FaultPlan().add("t", "eio", rate=0.0), 1000) == []
    assert len(_draws(FaultPlan().add("t", "eio", rate=1.0), 1000)) == 1000
    fired = len(_draws(FaultPlan(seed=11).add("t", "eio", rate=0.3), 10_000))
    assert 2700 < fired < 3300


def test_a_schedule_and_a_rate_combine() -> None:
    plan = FaultPlan().add("t", "eio", rate=1.0, schedule=[3])
    assert len(_draws(plan, 5)) == 5


def test_ops_limit_a_fault_to_those_calls() -> None:
    plan = FaultPlan().add("t", "eio", rate=1.0, ops=["put", "flush"])
    assert _draws(plan, 5, op="get") == []
    assert _draws(plan, 3, op="delete") == []
    assert len(_draws(plan, 4, op="put")) == 4
    assert len(_draws(plan, 2, op="flush")) == 2
    assert plan.faults[0].calls == 6  # the other calls are not its calls at all


def test_faults_fire_only_at_their_tier_and_where_they_can_happen() -> None:
    plan = FaultPlan().add("nvme", "flip", rate=1.0).add("nvme", "torn", rate=1.0)
    assert _draws(plan, 5, tier="pmem", kinds=DEVICE_FAULTS) == []
    assert _draws(plan, 5, tier="nvme", kinds=TIER_FAULTS) == []  # a tier wrapper flips nothing
    assert len(_draws(plan, 5, tier="nvme", kinds=("flip",))) == 5


def test_at_most_one_fault_fires_per_call() -> None:
    plan = FaultPlan().add("t", "latency", rate=1.0, arg=0.01).add("t", "eio", rate=1.0)
    for _ in range(5):
        fault = plan.draw("t", "get", TIER_FAULTS)
        assert fault is not None and fault.kind == "latency"
    assert plan.fired == {"t:latency": 5}


def test_a_disabled_plan_fires_nothing_and_counts_no_calls() -> None:
    plan = FaultPlan().add("t", "eio", rate=1.0, schedule=[1])
    plan.enabled = False
    assert _draws(plan, 10) == []
    assert plan.faults[0].calls == 0 and not plan.fired
    plan.enabled = True
    assert _draws(plan, 2) == [1, 2]


def test_a_seed_makes_the_same_faults_fire() -> None:
    spec = "t:eio=0.5,t:latency=0.3@1ms"

    def kinds(seed: int) -> list[str | None]:
        plan = FaultPlan.parse(spec, seed=seed)
        return [getattr(plan.draw("t", "get", TIER_FAULTS), "kind", None) for _ in range(300)]

    assert kinds(7) == kinds(7)
    assert kinds(7) != kinds(8)


# -- the tier wrapper ----------------------------------------------------------------------------
def _gpu(name: str = "l1") -> GpuTier:
    return GpuTier(GpuTierConfig(name, 64 << 10, "cpu", 4096, ttl=60.0))


def _meta(data: bytes) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), len(data), 1)


async def test_a_faulty_tier_looks_like_its_tier() -> None:
    inner = _gpu()
    tier = faulty(inner, FaultPlan())
    assert isinstance(tier, Tier)
    assert (tier.name, tier.kind, tier.persistent, tier.reclaims_space, tier.shared) == (
        inner.name, inner.kind, inner.persistent, inner.reclaims_space, inner.shared)
    await tier.open()
    try:
        assert tier.capacity == inner.capacity
        await tier.put(b"k", _meta(b"v"), b"v")
        got = await tier.get(b"k")
        assert got is not None and payload_bytes(got[1]) == b"v"
        assert tier.stats()["faults_fired"] == {}
    finally:
        await tier.close()


@pytest.mark.parametrize(("kind", "code"), [("eio", errno.EIO), ("enospc", errno.ENOSPC)])
async def test_an_error_fault_fails_the_call_without_making_it(kind: str, code: int) -> None:
    plan = FaultPlan().add("l1", kind, rate=1.0, ops=["put"])
    inner = _gpu()
    tier = faulty(inner, plan)
    await tier.open()
    try:
        with pytest.raises(DeviceError) as caught:
            await tier.put(b"k", _meta(b"v"), b"v")
        assert caught.value.errno == code
        assert await inner.get(b"k") is None  # the call was not made
        assert tier.stats()["faults_fired"] == {f"l1:{kind}": 1}
    finally:
        await tier.close()


async def test_latency_delays_and_a_hang_ends_only_when_cancelled() -> None:
    plan = FaultPlan().add("l1", "latency", rate=1.0, arg=0.05, ops=["get"])
    plan.add("l1", "hang", rate=1.0, ops=["delete"])
    tier = faulty(_gpu(), plan)
    await tier.open()
    try:
        await tier.put(b"k", _meta(b"v"), b"v")
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await tier.get(b"k") is not None
        assert loop.time() - started >= 0.05
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(tier.delete(b"k"), 0.2)
        assert await tier.contains(b"k")  # the hung delete never reached the tier
    finally:
        await tier.close()


async def test_faults_that_could_never_fire_are_refused(tmp_path: Path) -> None:
    config = {"tiers": [
        {"name": "gpu", "kind": "gpu", "device": "cpu", "capacity": "64KiB",
         "slot_size": "4KiB"},
        {"name": "pmem", "kind": "pmem", "path": str(tmp_path / "pool"), "capacity": "8MiB"},
    ]}
    for spec in ("nvme:eio=0.1", "gpu:eio=0.1", "pmem:flip=0.1", "pmem:torn=0.1"):
        with pytest.raises(ConfigError):
            await open_with_faults(config, FaultPlan.parse(spec))
    assert not (tmp_path / "pool").exists()  # refused before anything was opened


# -- the block device wrapper --------------------------------------------------------------------
class _MemoryDevice:
    """A block device in memory, as `FaultyBlockIO` sees one."""

    name = "memory"

    def __init__(self, size: int) -> None:
        self.media = bytearray(os.urandom(size))

    async def read(self, buf: Any, offset: int, length: int) -> None:
        buf[:length] = self.media[offset : offset + length]

    async def write(self, buf: Any, offset: int, length: int, start: int = 0, *,
                    urgent: bool = False) -> None:
        self.media[offset : offset + length] = buf[start : start + length]


def _bits_apart(a: bytes | bytearray, b: bytes | bytearray) -> int:
    return sum((x ^ y).bit_count() for x, y in zip(a, b, strict=True))


async def test_a_flip_changes_exactly_one_bit_of_what_was_read() -> None:
    device = _MemoryDevice(64 * BLOCK)
    plan = FaultPlan(seed=5).add("nvme", "flip", rate=1.0)
    io = FaultyBlockIO(device, plan, "nvme")
    where = set()
    for n in range(50):
        offset = n % 60 * BLOCK
        buf = bytearray(2 * BLOCK)
        await io.read(buf, offset, 2 * BLOCK)
        stored = device.media[offset : offset + 2 * BLOCK]
        assert _bits_apart(buf, stored) == 1
        where.add(next(i for i, (x, y) in enumerate(zip(buf, stored, strict=True)) if x != y))
    assert len(where) > 40  # anywhere in the read, not one fixed place
    assert plan.fired == {"nvme:flip": 50}


async def test_a_torn_write_lands_half_and_fails() -> None:
    device = _MemoryDevice(16 * BLOCK)
    before = bytes(device.media)
    io = FaultyBlockIO(device, FaultPlan().add("nvme", "torn", schedule=[1]), "nvme")
    data = os.urandom(8 * BLOCK)
    with pytest.raises(DeviceError) as caught:
        await io.write(bytearray(data), 4 * BLOCK, 8 * BLOCK)
    assert caught.value.errno == errno.EIO
    assert device.media[4 * BLOCK : 8 * BLOCK] == data[: 4 * BLOCK]  # the first half landed
    assert device.media[8 * BLOCK :] == before[8 * BLOCK :]  # the rest never did
    await io.write(bytearray(data), 4 * BLOCK, 8 * BLOCK)  # the next write is whole
    assert device.media[4 * BLOCK : 12 * BLOCK] == data


# -- faults reaching a real nvme tier ------------------------------------------------------------
def _block_sized(i: int) -> int:
    """A payload size for `key(i)` whose log entry is whole device blocks: entries of it, put
    one after another into a region, start and end on block boundaries, so that a read of one
    reads nothing but that entry (and a flip anywhere in it hits the entry)."""
    return next(size for size in range(20_000, 30_000) if entry_bytes(i, size) % BLOCK == 0)


async def _open_faulty_nvme(config: Any, plan: FaultPlan) -> tuple[Tier, NvmeTier]:
    """The nvme tier of `config` wrapped in `plan`'s faults (its block device too), and the
    tier itself; opened with `plan` quiet (the faults are for the data path, not recovery)."""
    inner = NvmeTier(config)
    tier = faulty(inner, plan)
    enabled, plan.enabled = plan.enabled, False
    try:
        await tier.open()
    finally:
        plan.enabled = enabled
    return tier, inner


async def test_a_flipped_bit_read_from_nvme_is_a_counted_miss(tmp_path: Path) -> None:
    config = nvme_config(tmp_path)
    keys = range(8)
    sizes = {i: _block_sized(i) for i in keys}
    tier = NvmeTier(config)
    await tier.open()
    for i in keys:
        data = payload_for(i, sizes[i])
        await tier.put(key(i), meta_of(data), data)
    await tier.flush()
    await tier.close()  # reads after the reopen come from the device, not a region buffer

    plan = FaultPlan().add("nvme", "flip", rate=1.0, ops=["get"])
    wrapped, inner = await _open_faulty_nvme(config, plan)
    try:
        for i in keys:
            assert await wrapped.get(key(i)) is None
        assert plan.fired == {"nvme:flip": len(keys)}  # one device read per get
        assert inner.stats()["checksum_failures"] == len(keys)
        assert wrapped.stats()["checksum_failures"] == len(keys)
    finally:
        await wrapped.close()


async def test_a_flip_never_serves_wrong_bytes(tmp_path: Path) -> None:
    """Entries of any size, flips at half the reads: a get is the stored bytes or a miss."""
    config = nvme_config(tmp_path)
    values = {i: payload_for(i, 1000 + 997 * i) for i in range(30)}
    tier = NvmeTier(config)
    await tier.open()
    for i, data in values.items():
        await tier.put(key(i), meta_of(data), data)
    await tier.close()
    plan = FaultPlan(seed=2).add("nvme", "flip", rate=0.5)
    _wrapped, inner = await _open_faulty_nvme(config, plan)
    try:
        misses = 0
        for i, data in values.items():
            got = await inner.get(key(i))
            if got is None:
                misses += 1
            else:
                assert payload_bytes(got[1]) == data
        assert 0 < misses == inner.stats()["checksum_failures"] <= plan.fired["nvme:flip"]
    finally:
        await inner.close()


@pytest.mark.parametrize("faulty_close", [False, True], ids=["clean-close", "faulty-close"])
async def test_a_torn_write_fails_the_flush_and_serves_nothing_torn(
        tmp_path: Path, faulty_close: bool) -> None:
    """What a flush made durable stays whole; of what the torn writes carried, every object is
    whole or absent after a reopen — whether the close itself still tore its writes or not."""
    config = nvme_config(tmp_path, regions=8)
    plan = FaultPlan(seed=4)
    _wrapped, inner = await _open_faulty_nvme(config, plan)
    durable = {i: payload_for(i, 20_000 + i) for i in range(20)}
    for i, data in durable.items():
        await inner.put(key(i), meta_of(data), data)
    await inner.flush()
    plan.add("nvme", "torn", rate=0.5, ops=["put"])
    torn = {i: payload_for(i, 30_000 + 7 * i) for i in range(20, 80)}  # 2 MiB: write-behind
    for i, data in torn.items():
        await inner.put(key(i), meta_of(data), data)
    with pytest.raises(DeviceError):
        await inner.flush()
    assert plan.fired["nvme:torn"] > 0
    plan.enabled = faulty_close
    await inner.close()

    reopened = NvmeTier(config)
    await reopened.open()
    try:
        for i, data in durable.items():
            got = await reopened.get(key(i))
            assert got is not None and payload_bytes(got[1]) == data
        whole = 0
        for i, data in torn.items():
            got = await reopened.get(key(i))
            if got is not None:
                assert payload_bytes(got[1]) == data
                whole += 1
        assert whole < len(torn)  # some writes really were torn
    finally:
        await reopened.close()
