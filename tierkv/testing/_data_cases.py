"""Conformance cases of a tier's lifecycle and data path: round trips, overwrites, deletes,
ownership of payloads, concurrency and a get racing a delete."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from tierkv.errors import EngineClosedError
from tierkv.formats.value import ObjectMeta, Payload, ValueKind, encode_value
from tierkv.testing._support import (
    RACE_ROUNDS,
    ConformanceBase,
    bytes_meta,
    key_of,
    pattern,
    payload_bytes,
)
from tierkv.tiers.base import Tier, TierState


class DataPathCases(ConformanceBase):
    """Lifecycle and data-path cases of the Tier contract."""

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

    @pytest.mark.parametrize("kind", [ValueKind.BYTES, ValueKind.TENSOR], ids=["bytes", "tensor"])
    @pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
    async def test_returned_payload_is_owned(self, tier: Tier, kind: ValueKind,
                                             large: bool) -> None:
        """Whatever type a tier returns, the caller owns it: changing it (or, for an immutable
        payload, a writable copy of it) changes nothing in the tier, and it is no view of tier
        memory: it keeps its bytes while the tier frees and reuses the memory it came from."""
        size = self._large_size(tier) if large else self.object_size
        data = pattern(b"owned", size)
        payload: Payload
        if kind is ValueKind.BYTES:
            meta, payload = bytes_meta(data), memoryview(data)
        else:
            meta, payload = encode_value(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        await tier.put(key_of(6), meta, payload)
        first, kept = await tier.get(key_of(6)), await tier.get(key_of(6))
        assert first is not None and kept is not None
        assert first[0] == meta and payload_bytes(first[1]) == data
        returned = first[1]
        assert isinstance(returned, bytes | bytearray | memoryview | torch.Tensor)
        if isinstance(returned, torch.Tensor):
            returned.fill_(0)
        elif isinstance(returned, bytes) or memoryview(returned).readonly:
            writable = bytearray(returned)
            writable[:] = bytes(size)
        else:
            memoryview(returned).cast("B")[:] = bytes(size)
        second = await tier.get(key_of(6))
        assert second is not None and payload_bytes(second[1]) == data
        assert await tier.delete(key_of(6))
        await self._reuse_memory(tier, size, first=20_000)
        assert payload_bytes(kept[1]) == data, "the payload aliased memory the tier reused"

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

    async def test_get_racing_delete_and_overwrite(self, tier: Tier) -> None:
        """Gets of a key in flight while it is deleted, its memory taken by other keys, and
        written anew, again and again: each returns one whole version of that key (the meta
        and the bytes of one generation) or None, never torn bytes or another key's."""
        size = min(tier.capacity // 8, 256 << 10)
        target = key_of(700)
        versions: dict[int, bytes] = {}
        readers: list[asyncio.Task[tuple[ObjectMeta, Payload] | None]] = []

        async def read(count: int) -> None:
            """`count` gets of the target, each started (up to its first await) on return."""
            readers.extend(asyncio.create_task(tier.get(target)) for _ in range(count))
            await asyncio.sleep(0)

        async def write(generation: int) -> None:
            versions[generation] = pattern(target + b"/%d" % generation, size)
            await self._put(tier, target, versions[generation], generation)

        await write(1)
        generation = 1
        for round_ in range(RACE_ROUNDS):
            await read(6)
            assert await tier.delete(target)
            fillers = [key_of(710 + 3 * round_ + i) for i in range(3)]
            for filler in fillers:  # the freed memory is there to be taken
                await self._put(tier, filler, pattern(filler, size))
            generation += 1
            await write(generation)
            await read(6)
            generation += 1
            await write(generation)  # an overwrite, with gets of the old version in flight
            await read(2)
            for filler in fillers:
                await tier.delete(filler)
        hits = 0
        for got in await asyncio.gather(*readers):
            if got is None:
                continue
            meta, payload = got
            assert meta.generation in versions, meta
            assert meta == bytes_meta(versions[meta.generation], meta.generation)
            assert payload_bytes(payload) == versions[meta.generation], "torn or foreign bytes"
            hits += 1
        assert hits, "no get found the key: nothing raced"
        final = await tier.get(target)
        assert final is not None and final[0].generation == generation
        assert payload_bytes(final[1]) == versions[generation]

    async def test_time_read_times_or_declines_and_changes_nothing(self, tier: Tier) -> None:
        """`time_read` answers seconds or ``None`` (the engine then times a probe object), and
        a timed read changes nothing stored."""
        data = {key_of(800 + i): pattern(key_of(800 + i), 5000 + i) for i in range(4)}
        for key, value in data.items():
            await self._put(tier, key, value)
        for nbytes in (4096, 256 << 10):
            seconds = await tier.time_read(nbytes)
            assert seconds is None or 0 < seconds < 60
        for key, value in data.items():
            got = await tier.get(key)
            assert got is not None and payload_bytes(got[1]) == value
