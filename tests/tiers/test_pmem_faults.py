"""Bad input and faults: foreign files, corrupt pools, a pool in use, a pool fuller than counted."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tierkv.config import PmemTierConfig
from tierkv.errors import DeviceError, TierFullError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.pmem import _pmemobj as pm
from tierkv.tiers.pmem.tier import PmemTier

pytestmark = pytest.mark.pmem

CAPACITY = 8 << 20


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make(path: Path, *, capacity: int = CAPACITY, fmt: bool = False) -> PmemTier:
    return PmemTier(PmemTierConfig("pmem", capacity, path, format=fmt))


def meta_of(size: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), size, 1)


@pytest.fixture
async def tier_pool(tmp_path: Path) -> AsyncIterator[Path]:
    """A tierkv pool holding one object, closed again."""
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    await tier.put(b"\x02k", meta_of(5), memoryview(b"hello"))
    await tier.close()
    yield path


async def assert_refused_untouched(path: Path, *, fmt: bool = False) -> None:
    before = digest(path)
    tier = make(path, fmt=fmt)
    with pytest.raises(DeviceError):
        await tier.open()
    await tier.close()
    assert digest(path) == before


async def test_other_layout_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.pool"
    pm.create_pool(path, "someone.else.v3", 16 << 20).close()
    await assert_refused_untouched(path)


async def test_non_pool_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(3 << 20))
    await assert_refused_untouched(path)


async def test_zero_filled_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "zeroed.pool"  # an empty file is new media (test_pmem_format.py)
    path.write_bytes(bytes(1 << 20))
    await assert_refused_untouched(path)


async def test_corrupt_pool_header_refused(tier_pool: Path) -> None:
    with tier_pool.open("r+b") as f:
        f.seek(40)  # inside the pool UUID: covered by the header checksum
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    await assert_refused_untouched(tier_pool)


async def test_format_replaces_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"not a pool")
    tier = make(path, fmt=True)
    assert await tier.open() == []
    try:
        await tier.put(b"\x02k", meta_of(2), memoryview(b"ok"))
        assert layout.inspect_pool(path).kind is layout.PoolFile.TIERKV
    finally:
        await tier.close()


async def test_format_recreates_corrupt_pool(tier_pool: Path) -> None:
    with tier_pool.open("r+b") as f:
        f.seek(40)
        f.write(b"\x00\x01\x02\x03")
    tier = make(tier_pool, fmt=True)
    assert await tier.open() == []
    await tier.close()


async def test_second_process_gets_in_use(tier_pool: Path) -> None:
    tier = make(tier_pool)
    await tier.open()
    script = textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        from tierkv.config import PmemTierConfig
        from tierkv.tiers.pmem.tier import PmemTier
        async def main():
            other = PmemTier(PmemTierConfig("pmem", {CAPACITY}, Path({str(tier_pool)!r})))
            try:
                await other.open()
            except Exception as exc:
                print(type(exc).__name__, "|", exc)
                return
            finally:
                await other.close()
            print("opened")
        asyncio.run(main())
    """)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        assert out.decode().split(" |")[0] == "DeviceError"
        # the holder is unaffected
        got = await tier.get(b"\x02k")
        assert got is not None and bytes(got[1]) == b"hello"
    finally:
        await tier.close()


async def test_same_process_second_open_refused(tier_pool: Path) -> None:
    first = make(tier_pool)
    await first.open()
    try:
        second = make(tier_pool, fmt=True)  # format must not override "in use"
        with pytest.raises(DeviceError):
            await second.open()
        await second.close()
        assert await first.contains(b"\x02k")
    finally:
        await first.close()


async def test_full_pool_is_tier_full_not_enomem(tmp_path: Path) -> None:
    """A pool with less free space than the tier counts (as fragmentation would leave it).

    The pool is made with the tier's layout and size, and most of it is taken by an oversized
    root object that the tier's accounting does not see; puts then hit PMDK's ENOMEM.
    """
    path = tmp_path / "tight.pool"
    size = layout.pool_size_for(CAPACITY)
    pool = pm.create_pool(path, layout.LAYOUT_NAME, size)
    try:
        pool.root(size - CAPACITY // 2 - (4 << 20))
    finally:
        pool.close()
    tier = make(path)
    await tier.open()
    try:
        stored = []
        with pytest.raises(TierFullError):
            for i in range(CAPACITY // (1 << 20)):
                key = b"\x02big-%d" % i
                await tier.put(key, meta_of(1 << 20), memoryview(bytearray(1 << 20)))
                stored.append(key)
        assert tier.used < tier.capacity  # PMDK, not the accounting, ran out
        assert tier.stats()["pool_full"] >= 1
        # the engine's answer: evict and retry
        for key in stored:
            assert await tier.delete(key)
        await tier.put(b"\x02big-again", meta_of(1 << 20), memoryview(bytearray(1 << 20)))
        assert await tier.contains(b"\x02big-again")
    finally:
        await tier.close()


async def test_capacity_refusal_before_pmdk(tmp_path: Path) -> None:
    tier = make(tmp_path / "tier.pool")
    await tier.open()
    try:
        assert not tier.can_ever_hold(CAPACITY)
        with pytest.raises(TierFullError):
            await tier.put(b"\x02huge", meta_of(CAPACITY), memoryview(bytearray(CAPACITY)))
        assert tier.used == 0
    finally:
        await tier.close()
