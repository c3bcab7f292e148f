"""The shared Tier conformance suite.

Every tier's tests subclass `TierConformance` and implement `make_tier`, which builds an *unopened*
tier whose media lives under the given directory (calling it twice with the same directory must
address the same media, so persistent tiers can be reopened). The suite then checks the contract
of `tierkv.tiers.base.Tier` through the public tier API only. Tests of capabilities a tier lacks
(persistence across reopen) skip themselves with a reason.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from tierkv.errors import EngineClosedError, TierFullError
from tierkv.formats.value import ObjectMeta, Payload, ValueKind, encode_value, payload_view
from tierkv.tiers.base import Tier, TierState


def payload_bytes(payload: Payload) -> bytes:
    """The bytes of any payload a tier returns (device tensors are copied to the host)."""
    return bytes(payload_view(payload))


def bytes_meta(data: bytes, generation: int = 1, parents: tuple[bytes, ...] = ()) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), len(data), generation, parents)


def key_of(i: int) -> bytes:
    return b"\x02conformance-" + str(i).encode()


class TierConformance:
    """Behaviour every tier shares; subclass it and implement `make_tier`."""

    #: payload size used by the fill tests; subclasses may lower it for tiny tiers
    object_size: int = 4096

    async def make_tier(self, directory: Path) -> Tier:
        raise NotImplementedError

    @pytest.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        tier = await self.make_tier(tmp_path)
        await tier.open()
        try:
            yield tier
        finally:
            await tier.close()

    async def _put(self, tier: Tier, key: bytes, data: bytes) -> list[bytes]:
        return list(await tier.put(key, bytes_meta(data), memoryview(data)))

    async def _put_making_room(self, tier: Tier, live: dict[bytes, bytes], key: bytes,
                               data: bytes) -> None:
        """Put like the engine does: on `TierFullError` free the oldest object and retry."""
        while True:
            try:
                dropped = await self._put(tier, key, data)
            except TierFullError:
                oldest = next(iter(live))
                assert await tier.delete(oldest)
                del live[oldest]
                continue
            for gone in dropped:
                live.pop(gone, None)
            live[key] = data
            return

    # -- lifecycle -------------------------------------------------------------------------------
    async def test_close_is_idempotent(self, tmp_path: Path) -> None:
        tier = await self.make_tier(tmp_path)
        await tier.open()
        await tier.close()
        await tier.close()
        assert tier.state is TierState.CLOSED

    async def test_use_after_close_raises(self, tmp_path: Path) -> None:
        tier = await self.make_tier(tmp_path)
        await tier.open()
        await tier.close()
        with pytest.raises(EngineClosedError):
            await tier.get(key_of(0))
        with pytest.raises(EngineClosedError):
            await self._put(tier, key_of(0), b"x")

    # -- data path -------------------------------------------------------------------------------
    async def test_get_missing_is_none(self, tier: Tier) -> None:
        assert await tier.get(key_of(404)) is None
        assert not await tier.contains(key_of(404))
        assert not await tier.delete(key_of(404))

    async def test_bytes_round_trip_keeps_meta(self, tier: Tier) -> None:
        data = os.urandom(self.object_size)
        meta = bytes_meta(data, generation=7, parents=(key_of(1), key_of(2)))
        await tier.put(key_of(0), meta, memoryview(data))
        assert await tier.contains(key_of(0))
        got = await tier.get(key_of(0))
        assert got is not None
        assert got[0] == meta
        assert payload_bytes(got[1]) == data

    async def test_tensor_round_trip(self, tier: Tier) -> None:
        tensor = torch.arange(self.object_size // 4, dtype=torch.float32).reshape(-1, 4)
        meta, payload = encode_value(tensor)
        meta = meta.with_generation(3)
        await tier.put(key_of(1), meta, payload)
        got = await tier.get(key_of(1))
        assert got is not None
        assert got[0] == meta
        assert payload_bytes(got[1]) == payload_bytes(payload)

    async def test_empty_payload(self, tier: Tier) -> None:
        await self._put(tier, key_of(2), b"")
        got = await tier.get(key_of(2))
        assert got is not None
        assert payload_bytes(got[1]) == b""

    async def test_overwrite_replaces(self, tier: Tier) -> None:
        await self._put(tier, key_of(3), b"a" * 100)
        await self._put(tier, key_of(3), b"b" * 50)
        got = await tier.get(key_of(3))
        assert got is not None
        assert payload_bytes(got[1]) == b"b" * 50
        assert list(tier.keys()).count(key_of(3)) == 1

    async def test_delete(self, tier: Tier) -> None:
        await self._put(tier, key_of(4), b"gone soon")
        assert await tier.delete(key_of(4))
        assert await tier.get(key_of(4)) is None
        assert not await tier.contains(key_of(4))
        assert key_of(4) not in set(tier.keys())

    async def test_put_copies_the_payload(self, tier: Tier) -> None:
        source = bytearray(b"x" * self.object_size)
        await tier.put(key_of(5), bytes_meta(bytes(source)), memoryview(source))
        source[:] = b"y" * self.object_size
        got = await tier.get(key_of(5))
        assert got is not None
        assert payload_bytes(got[1]) == b"x" * self.object_size

    async def test_returned_payload_is_owned(self, tier: Tier) -> None:
        await self._put(tier, key_of(6), b"z" * self.object_size)
        first = await tier.get(key_of(6))
        assert first is not None
        payload = first[1]
        if isinstance(payload, torch.Tensor):
            payload.fill_(0)
        elif isinstance(payload, bytearray | memoryview) and not memoryview(payload).readonly:
            payload[:] = bytes(len(payload))
        second = await tier.get(key_of(6))
        assert second is not None
        assert payload_bytes(second[1]) == b"z" * self.object_size

    async def test_get_many_in_order(self, tier: Tier) -> None:
        for i in range(5):
            await self._put(tier, key_of(100 + i), bytes([i]) * 10)
        results = await tier.get_many([key_of(104), key_of(999), key_of(100)])
        assert results[1] is None
        assert results[0] is not None and payload_bytes(results[0][1]) == bytes([4]) * 10
        assert results[2] is not None and payload_bytes(results[2][1]) == bytes([0]) * 10

    async def test_concurrent_puts_and_gets(self, tier: Tier) -> None:
        datas = {key_of(200 + i): os.urandom(257 + i) for i in range(32)}
        await asyncio.gather(*(self._put(tier, k, v) for k, v in datas.items()))
        results = await asyncio.gather(*(tier.get(k) for k in datas))
        for (_key, data), got in zip(datas.items(), results, strict=True):
            assert got is not None
            assert payload_bytes(got[1]) == data

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
        base = tier.used
        await self._put(tier, key_of(9), b"q" * self.object_size)
        assert tier.used > base
        await tier.delete(key_of(9))
        await tier.flush()
        assert tier.used <= base + tier.footprint(self.object_size)

    # -- persistence -----------------------------------------------------------------------------
    async def test_reopen_recovers_objects(self, tmp_path: Path) -> None:
        tier = await self.make_tier(tmp_path)
        if not tier.persistent:
            pytest.skip(f"{type(tier).__name__} is volatile: nothing to recover")
        await tier.open()
        datas = {key_of(300 + i): os.urandom(100 + i) for i in range(10)}
        for k, v in datas.items():
            await self._put(tier, k, v)
        await tier.delete(key_of(300))
        await tier.close()
        again = await self.make_tier(tmp_path)
        recovered = await again.open()
        try:
            assert {r.key for r in recovered} == set(datas) - {key_of(300)}
            for k, v in datas.items():
                got = await again.get(k)
                if k == key_of(300):
                    assert got is None
                else:
                    assert got is not None and payload_bytes(got[1]) == v
        finally:
            await again.close()
