"""Records packed into snug allocation classes: capacity efficiency at KV-block sizes, and pools
whose snug runs are reopened, freed into and filled again.

The rule (`tierkv.formats.pmem_layout`): a power-of-two payload from 4 KiB to 64 KiB whose record
fits `SNUG_HEADROOM` beside it is allocated from a class of exactly payload + headroom bytes; a
record with a longer header takes the grid's class of its size.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierkv.config import PmemTierConfig
from tierkv.errors import TierFullError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.keys import BlockKey, encode_key
from tierkv.tiers.pmem.tier import PmemTier

pytestmark = pytest.mark.pmem

KV_BLOCK = 16 << 10
CAPACITY = 8 << 20


def block(i: int) -> bytes:
    """A chained KV block's key as the engine stores it (a 16-byte digest and its context)."""
    return encode_key(BlockKey(i.to_bytes(16, "little"), 4096, 10000.0))


def meta_of(i: int, nbytes: int, parents: int = 1) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), nbytes, 1,
                      tuple(block(i + 1_000_000 + n) for n in range(parents)))


def payload_for(i: int, nbytes: int) -> bytes:
    return (i.to_bytes(8, "little") * (nbytes // 8 + 1))[:nbytes]


def tier_at(path: Path) -> PmemTier:
    return PmemTier(PmemTierConfig("pmem", CAPACITY, path / "tier.pool"))


async def fill(tier: PmemTier, start: int, nbytes: int, parents: int = 1) -> list[int]:
    """Put blocks from `start` on until the tier is full; the ones it took."""
    taken = []
    i = start
    while tier.fits(nbytes):
        try:
            await tier.put(block(i), meta_of(i, nbytes, parents), payload_for(i, nbytes))
        except TierFullError:
            break
        taken.append(i)
        i += 1
    return taken


async def assert_holds(tier: PmemTier, blocks: list[int], nbytes: int) -> None:
    for i in blocks:
        got = await tier.get(block(i))
        assert got is not None, i
        assert bytes(got[1]) == payload_for(i, nbytes), i


@pytest.mark.parametrize("payload", layout.SNUG_PAYLOADS, ids=lambda n: f"{n >> 10}KiB")
def test_each_snug_payload_with_the_allowed_header_takes_its_snug_class(payload: int) -> None:
    # the size the tier estimates an object at fits the class too
    unit = layout.record_footprint(layout.HEADER_ALLOWANCE + payload)
    assert unit == payload + layout.SNUG_HEADROOM
    cls = layout.size_class(layout.HEADER_ALLOWANCE + payload)
    assert cls is not None and cls.run_bytes <= cls.units_per_run * cls.unit * 65 // 64


async def test_16k_blocks_fill_at_least_97_percent_of_the_capacity(tmp_path: Path) -> None:
    """16 KiB blocks with a key and a parent: 98 % of the capacity is payload (94 % in the grid's
    class of 17,408 bytes). A ratio of bytes, not a timing."""
    tier = tier_at(tmp_path)
    await tier.open()
    try:
        taken = await fill(tier, 0, KV_BLOCK)
        assert len(taken) * KV_BLOCK >= 0.97 * tier.capacity, (len(taken), tier.capacity)
        assert tier.footprint(KV_BLOCK) == KV_BLOCK + layout.SNUG_HEADROOM
        assert tier.used == len(taken) * tier.footprint(KV_BLOCK)
        await assert_holds(tier, taken, KV_BLOCK)
    finally:
        await tier.close()


async def test_a_longer_header_takes_the_grid_class_and_reads_back(tmp_path: Path) -> None:
    tier = tier_at(tmp_path)
    await tier.open()
    try:
        await tier.put(block(1), meta_of(1, KV_BLOCK, parents=8), payload_for(1, KV_BLOCK))
        assert tier.used > KV_BLOCK + layout.SNUG_HEADROOM
        await assert_holds(tier, [1], KV_BLOCK)
    finally:
        await tier.close()


async def test_snug_runs_reopened_freed_into_and_filled_again(tmp_path: Path) -> None:
    """A full pool of snug records, reopened: every record reads back; half deleted, the space
    taken again by new records (PMDK reuses the freed units of the reopened runs), reopened again:
    byte for byte what the tier acknowledged, and the space accounting agrees with the pool."""
    tier = tier_at(tmp_path)
    await tier.open()
    try:
        first = await fill(tier, 0, KV_BLOCK)
    finally:
        await tier.close()
    tier = tier_at(tmp_path)
    await tier.open()
    try:
        await assert_holds(tier, first, KV_BLOCK)
        gone = first[::2]
        for i in gone:
            assert await tier.delete(block(i))
        kept = first[1::2]
        again = await fill(tier, 10_000, KV_BLOCK)
        assert len(again) >= len(gone)  # the freed units were taken again
        assert tier.used <= tier.capacity
    finally:
        await tier.close()
    tier = tier_at(tmp_path)
    await tier.open()
    try:
        await assert_holds(tier, kept + again, KV_BLOCK)
        for i in gone:
            assert await tier.get(block(i)) is None
        assert sorted(tier.keys()) == sorted(block(i) for i in kept + again)
        assert tier.used == len(kept + again) * tier.footprint(KV_BLOCK)
    finally:
        await tier.close()


async def test_mixed_snug_and_grid_sizes_survive_a_reopen(tmp_path: Path) -> None:
    """Every snug payload beside sizes just above and below it, one pool, reopened."""
    sizes = [n + d for n in layout.SNUG_PAYLOADS for d in (-64, 0, 100)]
    tier = tier_at(tmp_path)
    await tier.open()
    try:
        stored = {i: os.urandom(size) for i, size in enumerate(sizes)}
        for i, size in enumerate(sizes):
            await tier.put(block(i), meta_of(i, size), stored[i])
    finally:
        await tier.close()
    tier = tier_at(tmp_path)
    await tier.open()
    try:
        for i in range(len(sizes)):
            got = await tier.get(block(i))
            assert got is not None and bytes(got[1]) == stored[i]
    finally:
        await tier.close()
