"""The large-object data path: chunked copy+hash, copy thread, concurrency, errors, cancelling."""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tierkv.config import PmemTierConfig
from tierkv.errors import TierFullError
from tierkv.formats import pmem_layout as layout
from tierkv.formats.header import ObjectHeader, checksum, encode_header
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.testing import cancel_at
from tierkv.tiers.pmem import _pmemobj as pm
from tierkv.tiers.pmem._native import load as load_native
from tierkv.tiers.pmem.tier import CHUNK, LARGE_COPY, PmemTier

pytestmark = pytest.mark.pmem

CAPACITY = 32 << 20
# not a multiple of CHUNK, so the last chunk is partial
LARGE = 2 * CHUNK + 12345
#: `short_checksum_payload`: its size (several chunks, the last one partial, for chunks of any
#: power of two up to 1 MiB) and its last 8 bytes (little endian), found by trying tails in turn
#: until the payload's xxh3-64 fell below 2**32 (as 1 in 2**32 payloads' does)
SHORT_CHECKSUM_SIZE = 3 * (1 << 20) + 12345
SHORT_CHECKSUM_TAIL = 6403148706


Make = Callable[[Path], PmemTier]


@pytest.fixture(params=[pytest.param(True, marks=pytest.mark.native), False],
                ids=["native", "python"])
def make(request: pytest.FixtureRequest) -> Make:
    """Tiers on the native copy paths (the library must be built: scripts/setup) or Python's."""
    native: bool = request.param
    if native:
        assert load_native() is not None, "the native pmem library is not built"
    return lambda path: PmemTier(PmemTierConfig("pmem", CAPACITY, path), native=native)


def meta_of(size: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), size, 1)


def short_checksum_payload() -> bytes:
    """A payload whose checksum msgpack encodes in 5 bytes, not the widest 9."""
    size = SHORT_CHECKSUM_SIZE
    body = (bytes(range(251)) * (size // 251 + 1))[: size - 8]
    return body + SHORT_CHECKSUM_TAIL.to_bytes(8, "little")


@pytest.mark.parametrize("size", [LARGE_COPY, CHUNK, LARGE], ids=["one-chunk", "chunk", "chunks"])
async def test_chunked_checksum_matches_one_shot(make: Make, tmp_path: Path, size: int) -> None:
    """The checksum written by the copy thread, in one call or chunk by chunk, is the one-shot
    xxh3 the recovery walk verifies."""
    path = tmp_path / "tier.pool"
    data = os.urandom(size)
    tier = make(path)
    await tier.open()
    try:
        await tier.put(b"\x02big", meta_of(size), data)
    finally:
        await tier.close()
    tier = make(path)
    recovered = await tier.open()
    try:
        assert [r.key for r in recovered] == [b"\x02big"]
        assert tier.stats()["corrupt_freed_at_open"] == 0
        got = await tier.get(b"\x02big")
        assert got is not None and bytes(got[1]) == data
    finally:
        await tier.close()
    # and the record on the media carries exactly the one-shot checksum
    pool = pm.open_pool(path, layout.LAYOUT_NAME)
    try:
        oid = pool.first()
        assert oid is not None
        record = ctypes.string_at(pool.direct(oid), pool.usable_size(oid))
        info = layout.decode_record(memoryview(record))
        assert info.header.payload_checksum == checksum(data)
    finally:
        pool.close()


async def test_shorter_header_moves_the_payload(make: Make, tmp_path: Path) -> None:
    """A checksum below 2**32 encodes shorter than the widest header a put sizes its record for
    (it learns the checksum only while it copies the payload): the payload is moved up behind
    the real header. A payload with such a checksum goes through `put`, and the record on the
    media holds it right behind its real header, as recovery and `get` find it."""
    path = tmp_path / "tier.pool"
    data = short_checksum_payload()
    assert checksum(data) < 2**32
    key, meta = b"\x02moved", meta_of(len(data))
    real = len(encode_header(ObjectHeader(key, meta, checksum(data))))
    widest = len(encode_header(ObjectHeader(key, meta, 2**64 - 1)))
    assert real < widest
    tier = make(path)
    await tier.open()
    try:
        await tier.put(key, meta, data)
        got = await tier.get(key)
        assert got is not None and bytes(got[1]) == data
    finally:
        await tier.close()
    pool = pm.open_pool(path, layout.LAYOUT_NAME)  # the media, bypassing the tier
    try:
        oid = pool.first()
        assert oid is not None and pool.next(oid) is None
        record = ctypes.string_at(pool.direct(oid), pool.usable_size(oid))
    finally:
        pool.close()
    info = layout.decode_record(memoryview(record))
    assert info.payload_offset == layout.PREFIX_SIZE + real
    assert record[info.payload_offset : info.payload_offset + len(data)] == data
    assert info.header.payload_checksum == checksum(data)
    tier = make(path)
    recovered = await tier.open()
    try:
        assert [r.key for r in recovered] == [key]
        assert tier.stats()["corrupt_freed_at_open"] == 0
        got = await tier.get(key)
        assert got is not None and bytes(got[1]) == data
    finally:
        await tier.close()


async def test_concurrent_large_puts_and_gets_keep_contents(make: Make, tmp_path: Path) -> None:
    tier = make(tmp_path / "tier.pool")
    await tier.open()
    try:
        datas = {b"\x02c-%d" % i: os.urandom(LARGE_COPY + 977 * i) for i in range(12)}
        await asyncio.gather(*(tier.put(k, meta_of(len(v)), v) for k, v in datas.items()))
        # overwrite half while reading all of them
        fresh = {k: os.urandom(len(v) + 1) for k, v in list(datas.items())[::2]}
        results = await asyncio.gather(
            *(tier.get(k) for k in datas),
            *(tier.put(k, meta_of(len(v)), v) for k, v in fresh.items()),
        )
        for (key, old), got in zip(datas.items(), results, strict=False):
            assert got is not None
            assert bytes(got[1]) in (old, fresh.get(key, old))
        datas.update(fresh)
        final = await tier.get_many(list(datas))
        for data, got in zip(datas.values(), final, strict=True):
            assert got is not None and bytes(got[1]) == data
        expected = sum(tier.footprint(len(v)) for v in datas.values())
        assert tier.used <= tier.capacity
        assert abs(tier.used - expected) <= len(datas) * 4096  # header-size rounding only
        for key in datas:
            assert await tier.delete(key)
        assert tier.used == 0
    finally:
        await tier.close()


async def test_returned_payload_is_a_writable_owned_buffer(make: Make, tmp_path: Path) -> None:
    """A tensor's payload is a writable buffer the caller owns; a bytes value comes back as
    `bytes`, copied into once, equally the caller's."""
    tier = make(tmp_path / "tier.pool")
    await tier.open()
    try:
        data = os.urandom(LARGE)
        tensor_meta = ObjectMeta(ValueKind.TENSOR, "uint8", (LARGE,), LARGE, 1)
        await tier.put(b"\x02own", tensor_meta, data)
        got = await tier.get(b"\x02own")
        assert got is not None
        payload = got[1]
        assert isinstance(payload, memoryview) and not payload.readonly
        payload[:] = bytes(LARGE)
        again = await tier.get(b"\x02own")
        assert again is not None and bytes(again[1]) == data
        for size in (LARGE, 100):  # the worker's copy and the inline one
            await tier.put(b"\x02bytes", meta_of(size), data[:size])
            first = await tier.get(b"\x02bytes")
            second = await tier.get(b"\x02bytes")
            assert first is not None and second is not None
            assert type(first[1]) is bytes and first[1] == data[:size]
            assert first[1] is not second[1] and second[1] == data[:size]
    finally:
        await tier.close()


async def test_worker_error_reaches_the_caller_and_used_stays_consistent(
        make: Make, tmp_path: Path) -> None:
    """PMDK's ENOMEM on a copy thread is TierFullError in the caller; `used` is unchanged."""
    path = tmp_path / "tight.pool"
    size = layout.pool_size_for(CAPACITY)
    pool = pm.create_pool(path, layout.LAYOUT_NAME, size)
    try:
        pool.root(size - (6 << 20))  # leave the pool far less room than the tier counts
    finally:
        pool.close()
    tier = make(path)
    await tier.open()
    try:
        before = tier.used
        with pytest.raises(TierFullError):
            for i in range(CAPACITY // LARGE):
                await tier.put(b"\x02f-%d" % i, meta_of(LARGE), bytes(LARGE))
                before = tier.used
        assert tier.used == before
        assert tier.stats()["pool_full"] == 1
    finally:
        await tier.close()


async def test_cancelled_large_put_leaves_nothing(make: Make, tmp_path: Path) -> None:
    """A large put cancelled at each of its awaits in turn (`cancel_at`; one is the wait for its
    copy on a worker) leaves nothing: a copy under way goes on (it holds the caller's buffer),
    then frees what it wrote and its reservation; `close` waits for it, and the reopened pool
    holds only the puts that were not cancelled. (Copies run on several workers: a later put
    may end first.)"""
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    size = 4 << 20
    try:
        cancelled, _ = await cancel_at(
            lambda k: tier.put(b"\x02gone-%d" % k, meta_of(size), bytes(size)))
        assert cancelled >= 1, "a large put never waited for its copy"
        assert await tier.delete(b"\x02gone-%d" % (cancelled + 1))  # the one not cancelled
        await tier.put(b"\x02sync", meta_of(LARGE), bytes(LARGE))
        for k in range(1, cancelled + 1):
            assert not await tier.contains(b"\x02gone-%d" % k)
    finally:
        await tier.close()
    assert 0 < tier.used <= tier.footprint(LARGE)  # the cancelled puts' bookkeeping has run
    tier = make(path)
    recovered = await tier.open()
    try:
        assert [r.key for r in recovered] == [b"\x02sync"]
        assert 0 < tier.used <= tier.footprint(LARGE)
        assert await tier.delete(b"\x02sync")
        assert tier.used == 0
    finally:
        await tier.close()


async def test_cancelled_large_get_keeps_the_object(make: Make, tmp_path: Path) -> None:
    """A large get cancelled at each of its awaits in turn, its key deleted while it waits
    there: the delete frees the object only once a copy under way is done, so other puts and
    gets meanwhile are intact; after `close` (which waits for the copies) the reopened pool
    is empty."""
    path = tmp_path / "tier.pool"
    tier = make(path)
    await tier.open()
    data = os.urandom(4 << 20)

    async def delete(_k: int) -> None:
        assert await tier.delete(b"\x02keep")  # freed only once a copy under way is done

    async def reuse(_k: int) -> None:
        await tier.put(b"\x02next", meta_of(len(data)), data)
        got = await tier.get(b"\x02next")
        assert got is not None and bytes(got[1]) == data
        assert await tier.delete(b"\x02next")
        await tier.put(b"\x02keep", meta_of(len(data)), data)  # for the next run

    try:
        await tier.put(b"\x02keep", meta_of(len(data)), data)
        cancelled, last = await cancel_at(lambda _k: tier.get(b"\x02keep"), meanwhile=delete,
                                          after=reuse)
        assert cancelled >= 1, "a large get never waited for its copy"
        assert last is not None and bytes(last[1]) == data
        assert await tier.delete(b"\x02keep")
    finally:
        await tier.close()
    assert tier.used == 0  # the deferred frees ran when the cancelled copies ended
    tier = make(path)
    assert await tier.open() == []
    try:
        assert tier.used == 0
    finally:
        await tier.close()
