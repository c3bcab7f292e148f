"""Conformance cases of persistence: reopen, flush durability across a crash, corruption on
media (through the media hooks; volatile tiers skip them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierkv.formats.value import ObjectMeta, encode_value
from tierkv.testing._support import (
    ConformanceBase,
    bytes_meta,
    key_of,
    media_dirs,
    payload_bytes,
)
from tierkv.tiers.base import Tier


class PersistenceCases(ConformanceBase):
    """Persistence cases of the Tier contract (volatile tiers skip them)."""

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
            # what the flush made durable says so (the engine's record of edges relies on it)
            assert all(tier.on_media(key) for key in expected)
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

    async def test_a_flushed_copy_is_on_media_only_in_a_persistent_tier(self, tier: Tier) -> None:
        """`on_media` is what a crash keeps: a volatile tier's copies are never there."""
        await self._put(tier, key_of(470), b"x" * 100)
        await tier.flush()
        assert tier.on_media(key_of(470)) == tier.persistent

    @pytest.mark.parametrize("crashed", [False, True], ids=["closed", "crash-image"])
    async def test_corrupt_payload_is_a_miss(self, tmp_path: Path, crashed: bool) -> None:
        """A payload damaged on the media is never served: its get is None (again and again),
        and every other object comes back byte for byte. Nor does it vanish unsaid: its key is
        still listed by `open` or reported by `damaged_at_open` (its owner tells it apart from
        a key never written)."""
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
            listed = {r.key for r in recovered}
            assert not listed & again.damaged_at_open()
            assert set(victims) <= listed | again.damaged_at_open()
            for victim in victims:
                assert await again.get(victim) is None
                assert await again.get(victim) is None
            for key, data in datas.items():
                if key not in victims:
                    got = await again.get(key)
                    assert got is not None and payload_bytes(got[1]) == data
        finally:
            await again.close()
