"""The shared Tier conformance suite.

Every tier's tests subclass `TierConformance` and implement `make_tier`, which builds an *unopened*
tier whose media lives under the given directory (calling it twice with the same directory must
address the same media, so persistent tiers can be reopened). The suite then checks the contract
of `tierkv.tiers.base.Tier` through the public tier API.

Media hooks. A persistent tier's subclass also implements `crash_image` and `corrupt_payload`,
which reach its media directly (the bytes `tierkv.formats` defines), bypassing the tier under
test, as zarr's store tests do with their backends: the suite uses them to open a tier on the
media as a kill -9 leaves it, and to damage one object on the media. Tests of what a tier lacks
(persistence, for a volatile tier; running out of space, for a tier that `reclaims_space`) skip
themselves with a reason.
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


def pattern(tag: bytes, size: int) -> bytes:
    """`size` bytes made of `tag` over and over: tell apart whose bytes a payload holds."""
    unit = b"<" + tag + b">"
    return (unit * (size // len(unit) + 1))[:size]


def media_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """Two empty directories: one for a tier's media, one for an image of it."""
    media, image = tmp_path / "media", tmp_path / "image"
    media.mkdir()
    image.mkdir()
    return media, image


def largest_holdable(tier: Tier) -> int:
    """The largest payload `tier.can_ever_hold` (it is monotonic, false above the capacity)."""
    low, high = 0, tier.capacity + 1
    assert tier.can_ever_hold(low) and not tier.can_ever_hold(high)
    while high - low > 1:
        middle = (low + high) // 2
        if tier.can_ever_hold(middle):
            low = middle
        else:
            high = middle
    return low


#: the most objects `TierConformance._reuse_memory` puts (a pool on a plain file msyncs each)
REUSE_OBJECTS = 512
#: rounds of deletes and overwrites under concurrent gets in the race test
RACE_ROUNDS = 8


class TierConformance:
    """Behaviour every tier shares; subclass it and implement `make_tier` (and, for a persistent
    tier, the media hooks)."""

    #: payload size used by the fill tests; subclasses may lower it for tiny tiers
    object_size: int = 4096

    async def make_tier(self, directory: Path) -> Tier:
        raise NotImplementedError

    # -- media hooks (persistent tiers) ----------------------------------------------------------
    def crash_image(self, directory: Path, into: Path) -> None:
        """Copy the media of the tier made by ``make_tier(directory)``, which is still open,
        into the empty directory `into`, byte for byte as it is at this moment and without
        closing anything: what a kill -9 now would leave. ``make_tier(into)`` must then address
        the copy. The suite closes the original before it opens the copy."""
        raise NotImplementedError(f"{type(self).__name__} has no crash_image hook")

    def corrupt_payload(self, directory: Path, key: bytes) -> None:
        """Damage, on the media under `directory` (no tier has it open), the payload bytes of
        the object stored under `key`, so that its checksum fails; every other object stays
        untouched. Fails (AssertionError) when no payload of `key` is on the media."""
        raise NotImplementedError(f"{type(self).__name__} has no corrupt_payload hook")

    # -- helpers ---------------------------------------------------------------------------------
    @pytest.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        tier = await self.make_tier(tmp_path)
        await tier.open()
        try:
            yield tier
        finally:
            await tier.close()

    async def _put(self, tier: Tier, key: bytes, data: bytes, generation: int = 1) -> list[bytes]:
        return list(await tier.put(key, bytes_meta(data, generation), memoryview(data)))

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

    async def _persistent_tier(self, directory: Path) -> Tier:
        """An unopened tier on `directory`; skips the test for a volatile tier."""
        tier = await self.make_tier(directory)
        if not tier.persistent:
            pytest.skip(f"{type(tier).__name__} is volatile: nothing survives on its media")
        return tier

    def _large_size(self, tier: Tier) -> int:
        """A payload size that takes the tiers' large-object paths (copies off the loop,
        recycled result buffers) and still fits a quarter of the tier."""
        size = min(tier.capacity // 4, 256 << 10)
        assert tier.can_ever_hold(size)
        return size

    async def _reuse_memory(self, tier: Tier, size: int, first: int) -> None:
        """Make the tier reuse the memory it holds objects and results in: objects of `size`
        put (and read) until the tier is full or has taken twice its capacity (at most
        `REUSE_OBJECTS` of them); then deleted again."""
        count = min(2 * tier.capacity // tier.footprint(size) + 2, REUSE_OBJECTS)
        filled: list[bytes] = []
        for i in range(count):
            key = key_of(first + i)
            try:
                await self._put(tier, key, pattern(key, size))
            except TierFullError:
                assert not tier.reclaims_space
                break
            filled.append(key)
            await tier.get(key)  # its result, dropped at once, is memory a later get may reuse
        assert filled
        await tier.flush()
        for key in filled:
            await tier.delete(key)

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

    # -- persistence -----------------------------------------------------------------------------
    async def test_reopen_recovers_objects(self, tmp_path: Path) -> None:
        media, _image = media_dirs(tmp_path)
        tier = await self._persistent_tier(media)
        await tier.open()
        datas = {key_of(300 + i): os.urandom(100 + i) for i in range(10)}
        for k, v in datas.items():
            await self._put(tier, k, v)
        await tier.delete(key_of(300))
        await tier.close()
        again = await self.make_tier(media)
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

    async def test_flush_is_durable_across_a_crash(self, tmp_path: Path) -> None:
        """Everything put (and deleted) before `flush()` returned is on the media as a kill -9
        right after it leaves it, byte for byte; a put after the flush is there whole or not
        at all."""
        media, image = media_dirs(tmp_path)
        tier = await self._persistent_tier(media)
        sizes = (0, 1, 100, self.object_size, 70_000, self._large_size(tier))
        expected: dict[bytes, tuple[ObjectMeta, bytes]] = {}
        await tier.open()
        try:
            for i, size in enumerate(sizes * 2):
                key, data = key_of(400 + i), os.urandom(size)
                expected[key] = (bytes_meta(data, generation=i + 1), data)
                await tier.put(key, expected[key][0], memoryview(data))
            tensor = torch.randn(16, 8)
            tensor_meta, tensor_payload = encode_value(tensor, parents=(key_of(400),))
            await tier.put(key_of(450), tensor_meta.with_generation(5), tensor_payload)
            expected[key_of(450)] = (tensor_meta.with_generation(5), payload_bytes(tensor_payload))
            overwritten = os.urandom(3000)
            await self._put(tier, key_of(403), overwritten, generation=99)
            expected[key_of(403)] = (bytes_meta(overwritten, 99), overwritten)
            assert await tier.delete(key_of(404))
            del expected[key_of(404)]
            assert sum(tier.footprint(len(v)) for _m, v in expected.values()) < tier.capacity
            await tier.flush()
            late = os.urandom(5000)
            await self._put(tier, key_of(460), late)
            self.crash_image(media, image)
        finally:
            await tier.close()
        crashed = await self.make_tier(image)
        recovered = await crashed.open()
        try:
            found = {r.key: r.meta for r in recovered}
            assert found.pop(key_of(460), bytes_meta(late)) == bytes_meta(late)
            assert found == {key: meta for key, (meta, _data) in expected.items()}
            for key, (meta, data) in expected.items():
                got = await crashed.get(key)
                assert got is not None, key
                assert got[0] == meta and payload_bytes(got[1]) == data
            late_got = await crashed.get(key_of(460))
            assert late_got is None or payload_bytes(late_got[1]) == late
            assert await crashed.get(key_of(404)) is None
        finally:
            await crashed.close()

    @pytest.mark.parametrize("crashed", [False, True], ids=["closed", "crash-image"])
    async def test_corrupt_payload_is_a_miss(self, tmp_path: Path, crashed: bool) -> None:
        """A payload damaged on the media is never served: its get is None (again and again),
        and every other object comes back byte for byte."""
        media, image = media_dirs(tmp_path)
        tier = await self._persistent_tier(media)
        await tier.open()
        datas: dict[bytes, bytes] = {}
        try:
            for i, size in enumerate((self.object_size, self._large_size(tier)) * 3):
                key = key_of(500 + i)
                datas[key] = os.urandom(size)
                await self._put(tier, key, datas[key])
            await tier.flush()
            if crashed:
                self.crash_image(media, image)
        finally:
            await tier.close()
        target = image if crashed else media
        victims = (key_of(502), key_of(503))  # a small and a large one
        for victim in victims:
            self.corrupt_payload(target, victim)
        again = await self.make_tier(target)
        recovered = await again.open()
        try:
            assert {r.key for r in recovered} <= set(datas)
            assert {r.key for r in recovered} >= set(datas) - set(victims)
            for victim in victims:
                assert await again.get(victim) is None
                assert await again.get(victim) is None
            for key, data in datas.items():
                if key not in victims:
                    got = await again.get(key)
                    assert got is not None and payload_bytes(got[1]) == data
        finally:
            await again.close()
