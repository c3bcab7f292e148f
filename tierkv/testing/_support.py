"""What the conformance case groups share: payload helpers, the hooks and the fixture.

`ConformanceBase` declares the hooks a tier's test class implements (see `conformance`); the
case groups (`_data_cases`, `_space_cases`, `_persistence_cases`) derive from it and
`TierConformance` joins them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tierkv.errors import TierFullError
from tierkv.formats.value import ObjectMeta, Payload, ValueKind, payload_view
from tierkv.tiers.base import Tier


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


class ConformanceBase:
    """What every case group shares: the hooks a tier's subclass implements (`make_tier`, and
    for a persistent tier the media hooks), the `tier` fixture and helpers."""

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
