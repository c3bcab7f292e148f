"""One meaning of `format` for the pmem tier, every kind of media under both settings.

`format = true` may overwrite media that is not a usable tierkv pool and never wipes a valid
one; with `format = false` only new media (no file, an empty file) gets a pool, anything else
that is not a valid pool is refused with a `DeviceError` naming the path, the file untouched.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tierkv.config import PmemTierConfig
from tierkv.errors import DeviceError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.pmem import _pmemobj as pm
from tierkv.tiers.pmem.tier import PmemTier

pytestmark = pytest.mark.pmem

CAPACITY = 8 << 20
KEY = b"\x02kept"
DATA = b"hello, pool"


def make(path: Path, *, fmt: bool) -> PmemTier:
    return PmemTier(PmemTierConfig("pmem", CAPACITY, path, format=fmt))


def meta_of(size: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), size, 1)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def write_pool(path: Path) -> None:
    """A valid tierkv pool at `path` holding `KEY`, closed again."""
    tier = make(path, fmt=False)
    await tier.open()
    try:
        await tier.put(KEY, meta_of(len(DATA)), DATA)
    finally:
        await tier.close()


def nothing(path: Path) -> None:
    pass


def empty(path: Path) -> None:
    path.touch()


def zero_filled(path: Path) -> None:
    path.write_bytes(bytes(16 << 20))


def foreign(path: Path) -> None:
    path.write_bytes(os.urandom(3 << 20))


def other_layout(path: Path) -> None:
    pm.create_pool(path, "someone.else.v3", 16 << 20).close()


async def damaged_pool_header(path: Path) -> None:
    await write_pool(path)
    with path.open("r+b") as f:
        f.seek(40)  # inside the pool UUID: covered by the header checksum
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))


async def zeroed_pool_header(path: Path) -> None:
    await write_pool(path)
    with path.open("r+b") as f:
        f.write(bytes(4096))  # PMDK's pool header; pmemobj's layout name behind it stays


async def damaged_root(path: Path) -> None:
    await write_pool(path)
    pool = pm.open_pool(path, layout.LAYOUT_NAME)
    try:
        address = pool.direct(pool.root(layout.ROOT_SIZE))
        garbage = b"NOTOURS!" + bytes(layout.ROOT_SIZE - 8)
        pool.memcpy_persist(address, garbage, layout.ROOT_SIZE)
        assert ctypes.string_at(address, 8) == b"NOTOURS!"
    finally:
        pool.close()


Prepare = Callable[[Path], None]
NEW: dict[str, Prepare] = {"absent": nothing, "empty": empty}
NOT_OURS: dict[str, Prepare] = {"zero-filled": zero_filled, "foreign": foreign,
                                "other-layout": other_layout}
Damage = Callable[[Path], Awaitable[None]]
DAMAGED: dict[str, Damage] = {"damaged-pool-header": damaged_pool_header,
                              "zeroed-pool-header": zeroed_pool_header,
                              "damaged-root": damaged_root}


async def assert_new_pool_works(path: Path, *, fmt: bool) -> None:
    """The tier opens empty on a tierkv pool at `path`, which keeps what is put into it."""
    tier = make(path, fmt=fmt)
    assert await tier.open() == []
    try:
        assert list(tier.keys()) == []
        await tier.put(b"\x02new", meta_of(3), b"new")
    finally:
        await tier.close()
    assert layout.inspect_pool(path).kind is layout.PoolFile.TIERKV
    tier = make(path, fmt=False)
    assert [r.key for r in await tier.open()] == [b"\x02new"]
    await tier.close()


async def assert_refused_untouched(path: Path) -> None:
    before = digest(path)
    tier = make(path, fmt=False)
    with pytest.raises(DeviceError) as raised:
        await tier.open()
    await tier.close()
    assert str(path) in str(raised.value)
    assert digest(path) == before


@pytest.mark.parametrize("fmt", [False, True], ids=["keep", "format"])
@pytest.mark.parametrize("prepare", NEW.values(), ids=NEW.keys())
async def test_new_media_gets_a_pool_whatever_format_says(tmp_path: Path, prepare: Prepare,
                                                          fmt: bool) -> None:
    path = tmp_path / "tier.pool"
    prepare(path)
    await assert_new_pool_works(path, fmt=fmt)


@pytest.mark.parametrize("prepare", NOT_OURS.values(), ids=NOT_OURS.keys())
async def test_media_not_ours_is_refused_untouched(tmp_path: Path, prepare: Prepare) -> None:
    path = tmp_path / "tier.pool"
    prepare(path)
    await assert_refused_untouched(path)


@pytest.mark.parametrize("prepare", NOT_OURS.values(), ids=NOT_OURS.keys())
async def test_format_replaces_media_not_ours(tmp_path: Path, prepare: Prepare) -> None:
    path = tmp_path / "tier.pool"
    prepare(path)
    await assert_new_pool_works(path, fmt=True)


@pytest.mark.parametrize("damage", [damaged_pool_header, zeroed_pool_header],
                         ids=["damaged-pool-header", "zeroed-pool-header"])
async def test_damaged_pool_header_is_refused_untouched(tmp_path: Path, damage: Damage) -> None:
    path = tmp_path / "tier.pool"
    await damage(path)
    await assert_refused_untouched(path)


async def test_a_truncated_pool_is_refused_untouched(tmp_path: Path) -> None:
    """A pool cut to half its size (a copy cut short): PMDK refuses it, and the open probe's
    recovery, which ran before the refusal, wrote into its lanes (PMDK's copy-on-write at open
    now keeps those writes in the probe's memory)."""
    path = tmp_path / "tier.pool"
    await write_pool(path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    await assert_refused_untouched(path)


async def test_damaged_root_is_refused_and_the_records_kept(tmp_path: Path) -> None:
    """PMDK opens such a pool (and updates its own run-time state in it): only the root is
    wrong, and the records stay where they were."""
    path = tmp_path / "tier.pool"
    await damaged_root(path)
    tier = make(path, fmt=False)
    with pytest.raises(DeviceError) as raised:
        await tier.open()
    await tier.close()
    assert str(path) in str(raised.value)
    assert record_keys(path) == [KEY]


def record_keys(path: Path) -> list[bytes]:
    """The keys of the records in the pool at `path`, read with the binding, not the tier."""
    pool = pm.open_pool(path, layout.LAYOUT_NAME)
    keys = []
    try:
        oid = pool.first()
        while oid is not None:
            raw = ctypes.string_at(pool.direct(oid), pool.usable_size(oid))
            keys.append(layout.decode_record(memoryview(raw)).header.key)
            oid = pool.next(oid)
    finally:
        pool.close()
    return keys


@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED.keys())
async def test_format_replaces_a_damaged_pool(tmp_path: Path, damage: Damage) -> None:
    path = tmp_path / "tier.pool"
    await damage(path)
    await assert_new_pool_works(path, fmt=True)


@pytest.mark.parametrize("fmt", [False, True], ids=["keep", "format"])
async def test_valid_pool_reopens_with_its_objects(tmp_path: Path, fmt: bool) -> None:
    path = tmp_path / "tier.pool"
    await write_pool(path)
    tier = make(path, fmt=fmt)
    assert [r.key for r in await tier.open()] == [KEY]
    try:
        got = await tier.get(KEY)
        assert got is not None and bytes(got[1]) == DATA
    finally:
        await tier.close()


async def test_format_never_replaces_a_pool_in_use(tmp_path: Path) -> None:
    path = tmp_path / "tier.pool"
    await write_pool(path)
    holder = make(path, fmt=False)
    await holder.open()
    try:
        other = make(path, fmt=True)
        with pytest.raises(DeviceError):
            await other.open()
        await other.close()
        got = await holder.get(KEY)
        assert got is not None and bytes(got[1]) == DATA
    finally:
        await holder.close()


async def test_two_opens_creating_one_new_pool_at_once_leave_one_pool_and_the_process_able(
        tmp_path: Path) -> None:
    """Two tiers in one process opening one path with no pool yet, at once: one creates the
    pool, the other is refused with a `DeviceError`; afterwards pools of that size open in this
    process (both creators made and removed the one temporary, both failed, and PMDK refused
    every later pool of that size in the process)."""
    path = tmp_path / "new.pool"
    first, second = make(path, fmt=False), make(path, fmt=False)
    results = await asyncio.gather(first.open(), second.open(), return_exceptions=True)
    opened = [tier for tier, result in zip((first, second), results, strict=True)
              if not isinstance(result, BaseException)]
    refused = [result for result in results if isinstance(result, BaseException)]
    assert len(opened) == 1 and len(refused) == 1, results
    assert isinstance(refused[0], DeviceError)
    await opened[0].put(KEY, meta_of(len(DATA)), DATA)
    await opened[0].close()
    assert sorted(os.listdir(tmp_path)) == ["new.pool"]
    for pool in (path, tmp_path / "other.pool"):  # the pool made, and a new one
        tier = make(pool, fmt=False)
        await tier.open()
        try:
            if pool == path:
                got = await tier.get(KEY)
                assert got is not None and bytes(got[1]) == DATA
        finally:
            await tier.close()
