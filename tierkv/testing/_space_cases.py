"""Conformance cases of a tier's space: capacity never exceeded, `used` and `fits`."""

from __future__ import annotations

import pytest

from tierkv.errors import TierFullError
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.testing._support import (
    ConformanceBase,
    key_of,
    largest_holdable,
    pattern,
    payload_bytes,
)
from tierkv.tiers.base import Tier


class SpaceCases(ConformanceBase):
    """Space cases of the Tier contract."""

    # -- space -----------------------------------------------------------------------------------
    async def test_capacity_is_never_exceeded(self, tier: Tier) -> None:
        live: dict[bytes, bytes] = {}
        count = 3 * tier.capacity // max(tier.footprint(self.object_size), 1) + 4
        for i in range(count):
            data = i.to_bytes(4, "little") * (self.object_size // 4)
            await self._put_making_room(tier, live, key_of(1000 + i), data)
            assert tier.used <= tier.capacity
        assert live, "the tier holds nothing after the fill"
        held = set(tier.keys())
        for key, data in live.items():
            if key in held:
                got = await tier.get(key)
                assert got is not None
                assert payload_bytes(got[1]) == data
        assert held <= set(live)

    async def test_object_larger_than_tier_is_refused(self, tier: Tier) -> None:
        size = tier.capacity + 1
        assert not tier.can_ever_hold(size)
        with pytest.raises(TierFullError):
            await tier.put(key_of(7), ObjectMeta(ValueKind.BYTES, "", (), size, 1),
                           memoryview(bytearray(size)))
        # nothing else was disturbed
        await self._put(tier, key_of(8), b"still fine")
        got = await tier.get(key_of(8))
        assert got is not None and payload_bytes(got[1]) == b"still fine"

    async def test_used_returns_to_zero(self, tier: Tier) -> None:
        """A delete gives back exactly what the put took, at once, and that space is really
        free: puts and deletes in turn of several times the capacity never run out of room
        (and, in a tier that reclaims space itself, never drop anything)."""
        base = tier.used
        await self._put(tier, key_of(9), b"q" * self.object_size)
        assert base < tier.used <= base + tier.footprint(self.object_size)
        assert await tier.delete(key_of(9))
        assert tier.used == base
        size = self._large_size(tier)
        data = pattern(b"cycle", size)
        for i in range(3 * tier.capacity // tier.footprint(size) + 2):
            assert await self._put(tier, key_of(10_000 + i), data) == []
            assert tier.used > base
            assert await tier.delete(key_of(10_000 + i))
            assert tier.used == base
        await tier.flush()
        assert tier.used == base

    async def test_fits_on_an_empty_tier_is_can_ever_hold(self, tier: Tier) -> None:
        largest = largest_holdable(tier)
        for size in (0, 1, self.object_size, largest, largest + 1, tier.capacity + 1):
            assert tier.fits(size) == tier.can_ever_hold(size), size
        data = pattern(b"largest", largest)
        await self._put(tier, key_of(30), data)
        got = await tier.get(key_of(30))
        assert got is not None and payload_bytes(got[1]) == data
        assert await tier.delete(key_of(30))

    async def test_fits_predicts_put(self, tier: Tier) -> None:
        """Filling with objects of mixed sizes: whenever `fits(n)` is true a put of n bytes
        succeeds, and whenever a put raises `TierFullError`, `fits` had said false; full,
        nothing fits; emptied, everything holdable fits again."""
        if tier.reclaims_space:
            pytest.skip(f"{type(tier).__name__} reclaims space itself: `fits` follows "
                        "`can_ever_hold` (test_fits_follows_can_ever_hold)")
        base = tier.used
        large = self._large_size(tier)
        sizes = (large, large // 2 + 1, self.object_size, 1)
        live: dict[bytes, int] = {}
        bound = 2 * tier.capacity // tier.footprint(1) + 16
        for i in range(bound):
            size = sizes[i % len(sizes)]
            key = key_of(40_000 + i)
            predicted = tier.fits(size)
            try:
                await self._put(tier, key, pattern(key, size))
            except TierFullError:
                assert not predicted, f"fits({size}) was true, yet the put found no room"
                if size == min(sizes):
                    break
            else:
                live[key] = size
            assert tier.used <= tier.capacity
        else:
            pytest.fail("the tier never filled up")
        assert live
        for size in sizes:
            assert not tier.fits(size), size
        for key, size in live.items():
            got = await tier.get(key)
            assert got is not None and payload_bytes(got[1]) == pattern(key, size)
            assert await tier.delete(key)
        assert tier.used == base
        for size in sizes:
            assert tier.fits(size) == tier.can_ever_hold(size)

    async def test_fits_follows_can_ever_hold(self, tier: Tier) -> None:
        """A tier that reclaims space itself makes room for anything it can hold: `fits` is
        `can_ever_hold` however full it is, and such puts succeed."""
        if not tier.reclaims_space:
            pytest.skip(f"{type(tier).__name__} does not reclaim space: `fits` tracks what is "
                        "free (test_fits_predicts_put)")
        largest = largest_holdable(tier)
        probes = (0, 1, self.object_size, largest, largest + 1, tier.capacity + 1)
        size = self._large_size(tier)
        for i in range(2 * tier.capacity // tier.footprint(size) + 2):
            await self._put(tier, key_of(50_000 + i), pattern(b"over", size))
            for probe in probes:
                assert tier.fits(probe) == tier.can_ever_hold(probe), probe
        data = pattern(b"largest", largest)
        await self._put(tier, key_of(32), data)
        got = await tier.get(key_of(32))
        assert got is not None and payload_bytes(got[1]) == data
        with pytest.raises(TierFullError):
            await self._put(tier, key_of(33), bytes(largest + 1))
