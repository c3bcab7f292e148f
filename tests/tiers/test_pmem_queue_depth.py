"""`queue_depth` bounds the pmem tier's large copies in flight, on both copy paths, and requests
waiting for a slot can be cancelled without leaving anything behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tierkv.config import PmemTierConfig
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers._copythreads import JobSlots
from tierkv.tiers.pmem._native import load as load_native
from tierkv.tiers.pmem.tier import LARGE_COPY, PmemTier

pytestmark = pytest.mark.pmem

DEPTH = 4
CAPACITY = 128 << 20
SIZE = LARGE_COPY  # the smallest payload that goes through the queue

Make = Callable[..., PmemTier]


@pytest.fixture(params=[pytest.param(True, marks=pytest.mark.native), False],
                ids=["native", "python"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Make:
    native: bool = request.param
    if native:
        assert load_native() is not None, "the native pmem library is not built"

    def build(depth: int = DEPTH) -> PmemTier:
        config = PmemTierConfig("pmem", CAPACITY, tmp_path / "tier.pool", queue_depth=depth)
        return PmemTier(config, native=native)

    return build


@pytest.fixture
async def tier(make: Make) -> AsyncIterator[PmemTier]:
    opened = make()
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


def meta_of(size: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), size, 1)


def key(i: int) -> bytes:
    return b"\x02qd-%d" % i


def payload(i: int, size: int = SIZE) -> bytes:
    return (b"%07d:" % i) * (size // 8) + bytes(size % 8)


async def put_all(tier: PmemTier, indices: range, size: int = SIZE) -> None:
    for i in indices:
        await tier.put(key(i), meta_of(size), payload(i, size))


async def get_checked(tier: PmemTier, i: int) -> None:
    got = await tier.get(key(i))
    assert got is not None and bytes(got[1]) == payload(i)


def copies(tier: PmemTier) -> tuple[int, int, int]:
    stats = tier.stats()
    return stats["copies_in_flight"], stats["copies_waiting"], stats["copies_in_flight_max"]


async def test_ten_thousand_concurrent_gets_keep_depth_copies_in_flight(tier: PmemTier) -> None:
    await put_all(tier, range(16))
    await asyncio.gather(*(get_checked(tier, i % 16) for i in range(10_000)))
    assert copies(tier) == (0, 0, DEPTH)  # the bound was reached, never passed


async def test_get_many_of_ten_thousand_keys_is_bounded(tier: PmemTier) -> None:
    await put_all(tier, range(8))
    # mostly misses, so that the results held at once stay small; every 8th key is a hit
    keys = [key(i % 8) if i % 8 == 0 else key(10_000 + i) for i in range(10_000)]
    results = await tier.get_many(keys)
    assert sum(result is not None for result in results) == 1250
    assert copies(tier)[2] <= DEPTH


async def test_concurrent_puts_and_gets_keep_depth_copies_in_flight(make: Make) -> None:
    tier = make()
    await tier.open()
    try:
        await put_all(tier, range(16))
        puts = [tier.put(key(i), meta_of(SIZE), payload(i)) for i in range(100, 1100)]
        gets = [get_checked(tier, i % 16) for i in range(2000)]
        await asyncio.gather(*puts, *gets)
        assert copies(tier) == (0, 0, DEPTH)
    finally:
        await tier.close()
    reopened = make()
    recovered = {r.key for r in await reopened.open()}
    try:
        assert recovered == {key(i) for i in [*range(16), *range(100, 1100)]}
        await asyncio.gather(*(get_checked(reopened, i) for i in range(100, 1100)))
    finally:
        await reopened.close()


async def test_a_waiter_cancelled_before_its_slot_leaves_nothing(make: Make) -> None:
    """Depth 1: a large put holds the slot while a put and a get wait; both are cancelled.
    The waiting put reserved no space that stays reserved, the waiting get holds no reader
    (so its object's space is freed on delete), and the tier closes at once."""
    tier = make(depth=1)
    await tier.open()
    try:
        await put_all(tier, range(1))
        busy = asyncio.ensure_future(tier.put(key(1), meta_of(8 << 20), payload(1, 8 << 20)))
        waiting = [asyncio.ensure_future(tier.put(key(2), meta_of(SIZE), payload(2))),
                   asyncio.ensure_future(tier.get(key(0)))]
        await asyncio.sleep(0)
        assert copies(tier)[:2] == (1, 2)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert all(task.cancelled() for task in waiting)
        assert copies(tier)[1] == 0
        await busy
        assert not await tier.contains(key(2))
        assert await tier.delete(key(0)) and await tier.delete(key(1))
        assert tier.used == 0
        assert copies(tier) == (0, 0, 1)
    finally:
        await asyncio.wait_for(tier.close(), 10)


async def test_cancelling_many_waiting_requests_keeps_the_tier_consistent(make: Make) -> None:
    tier = make()
    await tier.open()
    try:
        await put_all(tier, range(16))
        tasks: list[asyncio.Future[object]] = [
            asyncio.ensure_future(tier.get(key(i % 16))) for i in range(500)]
        tasks += [asyncio.ensure_future(tier.put(key(i), meta_of(SIZE), payload(i)))
                  for i in range(100, 300)]
        await asyncio.sleep(0)
        assert copies(tier)[1] > 0  # most of them wait for a slot
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert copies(tier)[1] == 0  # the copies already submitted still run
        # every later get and put works; a cancelled put left its key whole or absent
        await asyncio.gather(*(get_checked(tier, i) for i in range(16)))
        landed = [i for i in range(100, 300) if await tier.contains(key(i))]
        await asyncio.gather(*(get_checked(tier, i) for i in landed))
        await put_all(tier, range(300, 310))
        kept, used = set(tier.keys()), tier.used
    finally:
        await asyncio.wait_for(tier.close(), 10)  # nothing left counted as running
    assert copies(tier) == (0, 0, DEPTH)
    reopened = make()
    recovered = {r.key for r in await reopened.open()}
    try:
        assert recovered == kept
        assert reopened.used == used  # no space was left counted for what was never written
        assert reopened.stats()["corrupt_freed_at_open"] == 0
        await asyncio.gather(*(get_checked(reopened, i) for i in [*range(16), *landed]))
        for k in kept:
            await reopened.delete(k)
        assert reopened.used == 0
    finally:
        await reopened.close()


# -- the slot counter on its own ------------------------------------------------------------------
async def test_slots_go_to_waiters_first_come_first_served() -> None:
    slots = JobSlots(asyncio.get_running_loop(), 1)
    await slots.take()
    order: list[int] = []

    async def wait(i: int) -> None:
        await slots.take()
        order.append(i)

    waiters = [asyncio.ensure_future(wait(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert (slots.in_flight, slots.waiting) == (1, 3)
    for _ in range(3):
        slots.give_back()
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2] and slots.in_flight == 1 and not slots.idle.is_set()
    slots.give_back()
    assert slots.in_flight == 0 and slots.idle.is_set()


async def test_a_slot_handed_to_a_cancelled_waiter_passes_on() -> None:
    """The slot reaches a waiter in the same step as its cancellation: it goes to the next."""
    slots = JobSlots(asyncio.get_running_loop(), 1)
    await slots.take()
    first = asyncio.ensure_future(slots.take())
    second = asyncio.ensure_future(slots.take())
    await asyncio.sleep(0)
    slots.give_back()  # to `first`, which has not run since
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert first.cancelled()
    await asyncio.wait_for(second, 1)
    assert (slots.in_flight, slots.waiting) == (1, 0)


async def test_cancelled_waiters_are_skipped_and_counted_out() -> None:
    slots = JobSlots(asyncio.get_running_loop(), 1)
    await slots.take()
    waiters = [asyncio.ensure_future(slots.take()) for _ in range(5)]
    await asyncio.sleep(0)
    for waiter in waiters[:4]:
        waiter.cancel()
    await asyncio.gather(*waiters[:4], return_exceptions=True)
    assert slots.waiting == 1
    slots.give_back()
    await asyncio.wait_for(waiters[4], 1)
    slots.give_back()
    assert (slots.in_flight, slots.waiting) == (0, 0) and slots.idle.is_set()


async def test_a_depth_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        JobSlots(asyncio.get_running_loop(), 0)
