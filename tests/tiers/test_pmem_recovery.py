"""Recovery: clean close and reopen; corruption found on the media at open and at read time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierkv.config import PmemTierConfig
from tierkv.errors import TierFullError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.header import ObjectHeader, checksum, encode_header
from tierkv.formats.value import ObjectMeta, ValueKind, encode_value
from tierkv.tiers.pmem import _pmemobj as pm
from tierkv.tiers.pmem.tier import LARGE_COPY, PmemTier

pytestmark = pytest.mark.pmem

CAPACITY = 16 << 20


def make(path: Path) -> PmemTier:
    return PmemTier(PmemTierConfig("pmem", CAPACITY, path))


def meta_of(data: bytes, generation: int = 1) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), len(data), generation)


def pattern(tag: int, size: int) -> bytes:
    """A payload whose bytes occur nowhere else in the pool file."""
    unit = b"<<tierkv-pattern-%04d>>" % tag
    return (unit * (size // len(unit) + 1))[:size]


def flip_in_file(path: Path, needle: bytes) -> None:
    data = path.read_bytes()
    offset = data.find(needle)
    assert offset >= 0 and data.find(needle, offset + 1) < 0
    with path.open("r+b") as f:
        f.seek(offset + len(needle) // 2)
        byte = f.read(1)
        f.seek(offset + len(needle) // 2)
        f.write(bytes([byte[0] ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())


async def test_clean_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    datas = {b"\x02small": os.urandom(100), b"\x02large": os.urandom(LARGE_COPY * 3),
             b"\x02empty": b"", b"\x02over": b"old"}
    for key, data in datas.items():
        await tier.put(key, meta_of(data), memoryview(data))
    await tier.put(b"\x02over", meta_of(b"new", 2), memoryview(b"new"))
    datas[b"\x02over"] = b"new"
    tensor = torch.randn(64, 33)
    tmeta, tpayload = encode_value(tensor)
    await tier.put(b"\x02tensor", tmeta, tpayload)
    await tier.put(b"\x02gone", meta_of(b"x"), memoryview(b"x"))
    await tier.delete(b"\x02gone")
    used = tier.used
    await tier.close()

    again = make(path)
    recovered = await again.open()
    try:
        assert {r.key for r in recovered} == {*datas, b"\x02tensor"}
        assert again.used == used
        for key, data in datas.items():
            got = await again.get(key)
            assert got is not None and bytes(got[1]) == data
        got = await again.get(b"\x02tensor")
        assert got is not None and got[0] == tmeta
        assert bytes(got[1]) == tensor.numpy().tobytes()
        stats = again.stats()
        assert stats["corrupt_freed_at_open"] == 0
        assert stats["objects"] == len(datas) + 1
    finally:
        await again.close()


@pytest.mark.parametrize("size", [1000, LARGE_COPY * 2])
async def test_payload_corruption_detected_at_open(tmp_path: Path, size: int) -> None:
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    for tag in range(3):
        data = pattern(tag, size)
        await tier.put(b"\x02key-%d" % tag, meta_of(data), memoryview(data))
    await tier.close()
    flip_in_file(path, pattern(1, size))

    again = make(path)
    recovered = await again.open()
    try:
        assert {r.key for r in recovered} == {b"\x02key-0", b"\x02key-2"}
        assert await again.get(b"\x02key-1") is None
        assert again.stats()["corrupt_freed_at_open"] == 1
        for tag in (0, 2):
            got = await again.get(b"\x02key-%d" % tag)
            assert got is not None and bytes(got[1]) == pattern(tag, size)
    finally:
        await again.close()

    third = make(path)  # the corrupt object was freed for good
    await third.open()
    try:
        assert third.stats()["corrupt_freed_at_open"] == 0
        assert len(list(third.keys())) == 2
    finally:
        await third.close()


async def test_corruption_while_open_is_a_counted_miss(tmp_path: Path) -> None:
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    try:
        for tag in range(2):
            data = pattern(tag, 5000)
            await tier.put(b"\x02key-%d" % tag, meta_of(data), memoryview(data))
        flip_in_file(path, pattern(0, 5000))  # the mapping is shared with the file
        assert await tier.get(b"\x02key-0") is None
        assert tier.stats()["checksum_misses"] == 1
        assert not await tier.contains(b"\x02key-0")
        got = await tier.get(b"\x02key-1")
        assert got is not None and bytes(got[1]) == pattern(1, 5000)
    finally:
        await tier.close()


def write_record(pool: pm.Pool, key: bytes, data: bytes, generation: int, sequence: int) -> None:
    header = encode_header(ObjectHeader(key, meta_of(data, generation), checksum(data)))
    record = layout.encode_prefix(sequence) + header + data

    def construct(address: int) -> None:
        pool.memcpy_persist(address, record, len(record))

    pool.alloc(len(record), layout.OBJECT_TYPE_NUM, construct)


async def test_duplicate_records_keep_the_newest(tmp_path: Path) -> None:
    """What a crash between allocating a new record and freeing the old one leaves behind."""
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    await tier.close()
    pool = pm.open_pool(path, layout.LAYOUT_NAME)
    try:
        write_record(pool, b"\x02a", b"gen-1", 1, 10)
        write_record(pool, b"\x02a", b"gen-2", 2, 5)  # generation wins over sequence
        write_record(pool, b"\x02b", b"seq-7", 1, 7)
        write_record(pool, b"\x02b", b"seq-8", 1, 8)
        pool.alloc(64, layout.OBJECT_TYPE_NUM, lambda address: None)  # zeroed: no record
    finally:
        pool.close()
    again = make(path)
    await again.open()
    try:
        got_a, got_b = await again.get(b"\x02a"), await again.get(b"\x02b")
        assert got_a is not None and bytes(got_a[1]) == b"gen-2"
        assert got_b is not None and bytes(got_b[1]) == b"seq-8"
        stats = again.stats()
        assert stats["superseded_freed_at_open"] == 2
        assert stats["corrupt_freed_at_open"] == 1
        await again.put(b"\x02c", meta_of(b"c"), memoryview(b"c"))  # sequence continues
    finally:
        await again.close()


async def test_smaller_capacity_keeps_what_it_holds_over_capacity(tmp_path: Path) -> None:
    """Reopened with a smaller capacity, the pool keeps every object, oldest first, over its
    capacity (the engine moves them out: freed here, they were lost where a tier below had
    room); no put fits until enough of them left."""
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    data = os.urandom(1 << 20)
    for i in range(12):
        await tier.put(b"\x02k%d" % i, meta_of(data), memoryview(data))
    await tier.close()
    smaller = PmemTier(PmemTierConfig("pmem", 8 << 20, path))
    recovered = await smaller.open()
    try:
        assert [r.key for r in recovered] == [b"\x02k%d" % i for i in range(12)]
        assert smaller.used > smaller.capacity
        assert smaller.stats()["over_capacity_at_open"] == smaller.used - smaller.capacity
        assert not smaller.fits(1)
        with pytest.raises(TierFullError):
            await smaller.put(b"\x02new", meta_of(b"n"), memoryview(b"n"))
        got = await smaller.get(b"\x02k0")
        assert got is not None and bytes(got[1]) == data
        for record in recovered:
            if smaller.used <= smaller.capacity - smaller.footprint(1):
                break
            assert await smaller.delete(record.key)
        await smaller.put(b"\x02new", meta_of(b"n"), memoryview(b"n"))
    finally:
        await smaller.close()


async def test_space_is_reusable_after_reopen(tmp_path: Path) -> None:
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    sizes = [100, 5000, 70_000, 300_000]
    i = 0
    while tier.fits(sizes[i % 4]):
        data = bytes(sizes[i % 4])
        await tier.put(b"\x02f%d" % i, meta_of(data), memoryview(data))
        i += 1
    await tier.close()
    again = make(path)
    await again.open()
    try:
        for key in list(again.keys()):
            await again.delete(key)
        assert again.used == 0
        big = again.capacity - (1 << 20)
        await again.put(b"\x02big", meta_of(bytes(big)), memoryview(bytearray(big)))
    finally:
        await again.close()
