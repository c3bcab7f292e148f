"""The native copy library (tierkv/_native): built, bit-compatible with the Python path."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import msgpack
import numpy as np
import pytest
import xxhash

from tierkv.config import PmemTierConfig
from tierkv.formats import pmem_layout as layout
from tierkv.formats.header import PREFIX, WIDEST_CHECKSUM, encode_header_parts
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.pmem import _pmemobj as pm
from tierkv.tiers.pmem._native import (
    NativeCopies,
    NativePut,
    abi_mismatch,
)
from tierkv.tiers.pmem._native import load as load_native
from tierkv.tiers.pmem.tier import PmemTier

pytestmark = pytest.mark.pmem


@pytest.fixture
def native() -> NativeCopies:
    loaded = load_native()
    assert loaded is not None, "the native pmem library is not built (scripts/setup builds it)"
    return loaded


def meta_of(size: int) -> ObjectMeta:
    return ObjectMeta(ValueKind.BYTES, "", (), size, 3, (b"\x02parent",))


@pytest.mark.native
@pytest.mark.parametrize("size", [0, 1, 63, 240, 4096, 16 << 10, (1 << 20) + 7])
def test_xxh3_agrees_with_python(native: NativeCopies, size: int) -> None:
    data = np.frombuffer(bytearray(os.urandom(size)) or bytearray(1), dtype=np.uint8)[:size]
    assert native.xxh3_64(int(data.ctypes.data), size) == xxhash.xxh3_64_intdigest(data.data)


@pytest.mark.native
@pytest.mark.parametrize("size", [100, 256 << 10, (1 << 20) + 3, 3 << 20])
def test_copy_verified_copies_and_checks(native: NativeCopies, size: int) -> None:
    """Below and above the streaming-store threshold, with a ragged tail."""
    source = np.frombuffer(bytearray(os.urandom(size)), dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    digest = xxhash.xxh3_64_intdigest(source.data)
    assert native.copy_verified(int(out.ctypes.data), int(source.ctypes.data), size, digest)
    assert out.tobytes() == source.tobytes()
    assert not native.copy_verified(int(out.ctypes.data), int(source.ctypes.data), size,
                                    digest ^ 1)


@pytest.mark.native
@pytest.mark.parametrize("checksum", [0, 5, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
                                      2**64 - 1])
def test_header_matches_python_for_every_checksum_width(native: NativeCopies, tmp_path: Path,
                                                        checksum: int) -> None:
    """The C constructor's last step (`tkv_write_header`) with a chosen checksum: every msgpack
    width, including the ones that move the payload up (1 in 2**32 in real use). It reads no
    pool, so the put is prepared with a null pool handle."""
    payload = os.urandom(4000)
    meta = meta_of(len(payload))
    parts = encode_header_parts(b"\x02key", meta)
    prefix = layout.encode_prefix(9)
    scratch = np.zeros(len(prefix) + PREFIX.size + len(parts.head) + WIDEST_CHECKSUM
                       + len(parts.tail) + len(payload), dtype=np.uint8)
    widest = scratch.nbytes - len(payload)
    scratch[widest:] = np.frombuffer(payload, dtype=np.uint8)
    put = NativePut(native, 0, prefix=prefix, parts=parts, payload_address=0,
                    payload_len=len(payload), type_num=layout.OBJECT_TYPE_NUM, keep=None)
    offset = native.write_header(put.address, int(scratch.ctypes.data), checksum)
    expected = prefix + parts.assemble(checksum)
    assert offset == len(expected)
    assert scratch[:offset].tobytes() == expected
    assert scratch[offset : offset + len(payload)].tobytes() == payload
    info = layout.decode_record(memoryview(scratch.tobytes()))
    assert info.header.payload_checksum == checksum and info.payload_offset == offset
    assert len(msgpack.packb(checksum)) == WIDEST_CHECKSUM - (widest - offset)


@pytest.mark.native
@pytest.mark.parametrize("size", [100, 96 << 10, (1 << 20) + 5])
async def test_native_record_is_the_python_record(tmp_path: Path, size: int) -> None:
    """The same put into two fresh pools, through the native and the Python copy path (inline
    below `LARGE_COPY`, on the workers above it): the records on the media are the same bytes."""
    payload = os.urandom(size)
    meta = meta_of(size)
    records = []
    for native in (True, False):
        path = tmp_path / f"{native}.pool"
        tier = PmemTier(PmemTierConfig("pmem", 16 << 20, path), native=native)
        await tier.open()
        try:
            await tier.put(b"\x02same", meta, payload)
        finally:
            await tier.close()
        pool = pm.open_pool(path, layout.LAYOUT_NAME)  # the media, bypassing the tier
        try:
            oid = pool.first()
            assert oid is not None and pool.next(oid) is None
            raw = ctypes.string_at(pool.direct(oid), pool.usable_size(oid))
        finally:
            pool.close()
        info = layout.decode_record(memoryview(raw))
        assert info.header.payload_checksum == xxhash.xxh3_64_intdigest(payload)
        records.append(raw[: info.record_size])
    assert records[0] == records[1]


@pytest.mark.parametrize("native", [pytest.param(True, marks=pytest.mark.native), False],
                         ids=["native", "python"])
async def test_stats_and_info_name_the_copy_path(tmp_path: Path, native: bool) -> None:
    expected = "native" if native else "python"
    tier = PmemTier(PmemTierConfig("pmem", 16 << 20, tmp_path / "tier.pool"), native=native)
    await tier.open()
    try:
        assert tier.stats()["copy_path"].startswith(expected)
        assert tier.describe()["copies"].startswith(expected)
    finally:
        await tier.close()


NATIVE_SOURCES = [Path(__file__).parents[2] / "tierkv" / "_native" / name
                  for name in ("pmem_copy.c", "copy_queue.c")]


def _build(tmp_path: Path, *flags: str, sources: list[Path] = NATIVE_SOURCES) -> ctypes.CDLL:
    if shutil.which("gcc") is None:
        pytest.skip("gcc: not installed (scripts/setup installs it)")
    out = tmp_path / "lib.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-pthread", *flags, "-o", str(out),
                    *map(str, sources)], check=True, capture_output=True)
    return ctypes.CDLL(str(out))


@pytest.mark.native
def test_built_library_matches_the_bindings(native: NativeCopies) -> None:
    assert abi_mismatch(ctypes.CDLL(str(native.path))) == ""


def test_stale_library_is_refused(tmp_path: Path) -> None:
    """Another ABI version, or a library from before versioning: never handed a structure."""
    other = _build(tmp_path, "-DTKV_ABI_VERSION=99")
    assert "ABI version 99" in abi_mismatch(other)
    source = tmp_path / "old.c"
    source.write_text("int tkv_copy_verified(void) { return 0; }\n")
    (tmp_path / "old").mkdir()
    older = _build(tmp_path / "old", sources=[source])
    assert "predates" in abi_mismatch(older)
