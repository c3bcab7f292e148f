"""GPU-tier specifics: slot accounting, contiguous runs, pins that outlive their key."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

from tierkv.config import GpuTierConfig
from tierkv.errors import TierFullError
from tierkv.formats.value import ObjectMeta, ValueKind, encode_value
from tierkv.testing import payload_bytes
from tierkv.tiers.base import ZeroCopyPinning
from tierkv.tiers.gpu.tier import GpuTier

SLOT = 1024


def meta(n: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), n, 1)


@pytest.fixture
async def tier() -> AsyncIterator[GpuTier]:
    gpu = GpuTier(GpuTierConfig("l1", 8 * SLOT, "cpu", SLOT, 5.0))
    await gpu.open()
    yield gpu
    await gpu.close()


async def test_objects_take_whole_slots(tier: GpuTier) -> None:
    await tier.put(b"a", meta(1), memoryview(b"x"))
    assert tier.used == SLOT
    await tier.put(b"b", meta(SLOT + 1), memoryview(b"y" * (SLOT + 1)))
    assert tier.used == 3 * SLOT
    assert tier.footprint(0) == 0


async def test_full_tier_refuses_until_space_is_freed(tier: GpuTier) -> None:
    for i in range(8):
        await tier.put(bytes([i]), meta(SLOT), memoryview(bytes(SLOT)))
    assert not tier.fits(1)
    with pytest.raises(TierFullError):
        await tier.put(b"more", meta(1), memoryview(b"z"))
    await tier.delete(bytes([3]))
    assert tier.fits(SLOT)
    assert not tier.fits(2 * SLOT)
    await tier.put(b"more", meta(1), memoryview(b"z"))


async def test_multi_slot_objects_need_a_contiguous_run(tier: GpuTier) -> None:
    for i in range(8):
        await tier.put(bytes([i]), meta(SLOT), memoryview(bytes(SLOT)))
    await tier.delete(bytes([1]))
    await tier.delete(bytes([3]))
    assert not tier.fits(2 * SLOT)  # two free slots, but not adjacent
    await tier.delete(bytes([2]))
    assert tier.fits(3 * SLOT)
    await tier.put(b"big", meta(3 * SLOT), memoryview(b"q" * (3 * SLOT)))
    got = await tier.get(b"big")
    assert got is not None and payload_bytes(got[1]) == b"q" * (3 * SLOT)


async def test_pin_is_zero_copy_and_survives_delete(tier: GpuTier) -> None:
    assert isinstance(tier, ZeroCopyPinning)
    tensor = torch.arange(64, dtype=torch.int32)
    tensor_meta, payload = encode_value(tensor)
    await tier.put(b"t", tensor_meta, payload)
    token, view = tier.acquire_pin(b"t")
    assert tier.is_pinned(b"t")
    view.view(torch.int32)[0] = 99  # writes through to the slot
    got = await tier.get(b"t")
    assert got is not None
    assert torch.frombuffer(bytearray(payload_bytes(got[1])), dtype=torch.int32)[0] == 99
    used = tier.used
    await tier.delete(b"t")
    assert tier.used == used  # still held by the pin
    for i in range(7):  # the other slots fill up without touching the pinned one
        await tier.put(bytes([i]), meta(SLOT), memoryview(bytes([i]) * SLOT))
    assert view.view(torch.int32)[0] == 99
    tier.release_pin(token)
    assert tier.used == 8 * SLOT  # the view lent by the pin is alive: its slot stays reserved
    del view
    assert tier.used == 7 * SLOT


async def test_a_host_view_keeps_its_slots_until_the_last_view_made_from_it_is_gone(
        tier: GpuTier) -> None:
    await tier.put(b"h", meta(SLOT), memoryview(b"h" * SLOT))
    lent = tier.lend_host(b"h")
    assert lent is not None
    token, view = lent
    del lent
    assert bytes(view) == b"h" * SLOT
    part = view[10:20]  # what a copy on a worker thread may still hold
    del view
    await tier.delete(b"h")
    tier.release_pin(token)
    for i in range(7):
        await tier.put(bytes([i]), meta(SLOT), memoryview(bytes([i]) * SLOT))
    assert tier.used == 8 * SLOT and not tier.fits(1)  # the lent slot is still reserved
    assert bytes(part) == b"h" * 10
    del part
    assert tier.used == 7 * SLOT and tier.fits(SLOT)
