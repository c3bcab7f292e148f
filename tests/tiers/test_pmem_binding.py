"""The libpmemobj ctypes binding, called directly against real pools (tmpfs and ext4 files)."""

from __future__ import annotations

import ctypes
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.errors import DeviceError
from tierkv.tiers.pmem import _pmemobj as pm

pytestmark = pytest.mark.pmem

LAYOUT = "tierkv.test.binding"
POOL_SIZE = 16 << 20
TYPE = 7


@pytest.fixture(params=["tmpfs", "ext4"])
def pool_path(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    # tmp_path is on ext4 here; /dev/shm is tmpfs
    directory = Path("/dev/shm") if request.param == "tmpfs" else tmp_path
    path = directory / f"tierkv-binding-{uuid.uuid4().hex}.pool"
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture
def pool(pool_path: Path) -> Iterator[pm.Pool]:
    pool = pm.create_pool(pool_path, LAYOUT, POOL_SIZE)
    try:
        yield pool
    finally:
        pool.close()


def writer(pool: pm.Pool, data: bytes) -> pm.Constructor:
    def construct(address: int) -> None:
        pool.memcpy_persist(address, data, len(data))

    return construct


def read(pool: pm.Pool, oid: pm.Oid, size: int) -> bytes:
    return ctypes.string_at(pool.direct(oid), size)


def walk(pool: pm.Pool) -> list[pm.Oid]:
    found = []
    oid = pool.first()
    while oid is not None:
        found.append(oid)
        oid = pool.next(oid)
    return found


def test_create_close_open_keeps_objects(pool_path: Path) -> None:
    pool = pm.create_pool(pool_path, LAYOUT, POOL_SIZE)
    payloads = [os.urandom(n) for n in (1, 100, 5000, 300_000)]
    try:
        oids = [pool.alloc(len(p), TYPE, writer(pool, p)) for p in payloads]
        pool.free(oids.pop(0))
    finally:
        pool.close()
    assert pool.closed
    again = pm.open_pool(pool_path, LAYOUT)
    try:
        found = walk(again)
        assert sorted(o.off for o in found) == sorted(o.off for o in oids)
        for oid in found:
            assert again.type_num(oid) == TYPE
        contents = {read(again, o, len(p)) for o, p in zip(oids, payloads[1:], strict=True)}
        assert contents == set(payloads[1:])
    finally:
        again.close()


def test_constructor_failure_allocates_nothing(pool: pm.Pool) -> None:
    def failing(address: int) -> None:
        raise RuntimeError("constructor refused")

    with pytest.raises(RuntimeError):
        pool.alloc(4096, TYPE, failing)
    assert walk(pool) == []


def test_walk_type_num_and_usable_size(pool: pm.Pool) -> None:
    sizes = {10: 1, 4000: 2, 70_000: 3}
    oids = {pool.alloc(size, t, writer(pool, b"")): size for size, t in sizes.items()}
    assert set(walk(pool)) == set(oids)
    for oid, size in oids.items():
        assert pool.type_num(oid) == sizes[size]
        assert pool.usable_size(oid) >= size


def test_root_is_zeroed_and_stable(pool: pm.Pool) -> None:
    first = pool.root(64)
    assert ctypes.string_at(pool.direct(first), 64) == bytes(64)
    assert pool.root(64) == first
    assert pool.root_size() >= 64
    assert first not in walk(pool)


def test_persist_after_plain_write(pool: pm.Pool) -> None:
    oid = pool.alloc(128, TYPE, writer(pool, b""))
    address = pool.direct(oid)
    ctypes.memmove(address, b"p" * 128, 128)
    pool.persist(address, 128)
    assert read(pool, oid, 128) == b"p" * 128


def test_custom_class_gives_its_unit(pool: pm.Pool) -> None:
    unit = 4096 + 64
    class_id = pool.register_class(unit, 60)
    flags = pm.class_flag(class_id) | pm.arena_flag(1)
    oid = pool.alloc(4000, TYPE, writer(pool, b"c" * 4000), flags)
    assert pool.usable_size(oid) == unit - 16
    assert read(pool, oid, 4000) == b"c" * 4000


def test_full_pool_is_enomem(pool: pm.Pool) -> None:
    with pytest.raises(DeviceError) as caught:
        pool.alloc(POOL_SIZE, TYPE, writer(pool, b""))
    assert pm.failure_errno(caught.value) == errno.ENOMEM
    oids = []
    with pytest.raises(DeviceError) as caught:
        while True:
            oids.append(pool.alloc(1 << 20, TYPE, writer(pool, b"")))
    assert pm.failure_errno(caught.value) == errno.ENOMEM
    assert oids, "a 16 MiB pool holds at least one 1 MiB object"
    for oid in oids:
        pool.free(oid)
    pool.alloc(1 << 20, TYPE, writer(pool, b""))


def test_errors_carry_errormsg(tmp_path: Path) -> None:
    with pytest.raises(DeviceError) as caught:
        pm.open_pool(tmp_path / "absent.pool", LAYOUT)
    cause = caught.value.__cause__
    assert isinstance(cause, OSError)
    assert cause.errno == errno.ENOENT
    assert cause.strerror  # pmemobj_errormsg() of the failing call


def test_create_over_existing_file_refused(pool_path: Path) -> None:
    pool_path.write_bytes(b"precious")
    with pytest.raises(DeviceError) as caught:
        pm.create_pool(pool_path, LAYOUT, POOL_SIZE)
    assert pm.failure_errno(caught.value) == errno.EEXIST
    assert pool_path.read_bytes() == b"precious"


def test_second_open_is_in_use(pool: pm.Pool, pool_path: Path) -> None:
    with pytest.raises(DeviceError) as caught:
        pm.open_pool(pool_path, LAYOUT)
    assert pm.failure_errno(caught.value) in pm.IN_USE_ERRNOS


def test_pmem_is_pmem_false_on_files(pool: pm.Pool) -> None:
    # tmpfs and ext4 (without DAX) are page cache, not persistent memory
    assert pool.is_pmem() is False


def test_closed_pool_refuses_calls(pool_path: Path) -> None:
    pool = pm.create_pool(pool_path, LAYOUT, POOL_SIZE)
    oid = pool.alloc(16, TYPE, writer(pool, b""))
    pool.close()
    pool.close()
    with pytest.raises(DeviceError):
        pool.direct(oid)
    with pytest.raises(DeviceError):
        pool.free(oid)


def test_bad_layout_name_rejected(pool_path: Path) -> None:
    with pytest.raises(ValueError):
        pm.create_pool(pool_path, "x" * pm.MAX_LAYOUT, POOL_SIZE)
    assert not pool_path.exists()
