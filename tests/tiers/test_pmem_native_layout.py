"""The native library's mirrors of the object-header layout agree with `formats.header`, and a
library whose mirror disagrees is refused at load like a stale build."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from tierkv.formats import header
from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers._native import library_path
from tierkv.tiers.pmem._native import MIRRORED_LAYOUT, abi_mismatch

SOURCES = [Path(__file__).parents[2] / "tierkv" / "_native" / name
           for name in ("pmem_copy.c", "copy_queue.c")]
#: the C names of `MIRRORED_LAYOUT`, in its order
C_NAMES = ("TKV_HEADER_PREFIX", "TKV_HEADER_LEAD", "TKV_BODY_LENGTH_AT", "TKV_BODY_CHECKSUM_AT",
           "TKV_WIDEST_UINT")


def build(tmp_path: Path, *flags: str) -> ctypes.CDLL:
    if shutil.which("gcc") is None:
        pytest.skip("gcc: not installed (scripts/setup installs it)")
    out = tmp_path / "lib.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-pthread", *flags, "-o", str(out),
                    *map(str, SOURCES)], check=True, capture_output=True)
    return ctypes.CDLL(str(out))


def test_the_mirrored_facts_are_the_header_format() -> None:
    """What the loader compares against is `formats.header`, not a copy of it."""
    lead = header.PREFIX.pack(header.MAGIC, header.FORMAT_VERSION, 0, 0x11223344,
                              0x5566778899AABBCC)
    assert lead[header.BODY_LENGTH_OFFSET : header.BODY_LENGTH_OFFSET + 4] == bytes.fromhex(
        "44332211")
    assert lead[header.BODY_CHECKSUM_OFFSET :] == bytes.fromhex("ccbbaa9988776655")
    assert lead[: header.LEAD_SIZE] == header.MAGIC + bytes([header.FORMAT_VERSION, 0, 0, 0])
    parts = header.encode_header_parts(b"\x02k", ObjectMeta(ValueKind.BYTES, "", (), 3, 1))
    assert len(parts.assemble(2**64 - 1)) == parts.widest_size
    assert [value for _name, value in MIRRORED_LAYOUT] == [
        header.PREFIX.size, header.LEAD_SIZE, header.BODY_LENGTH_OFFSET,
        header.BODY_CHECKSUM_OFFSET, header.WIDEST_CHECKSUM]


@pytest.mark.native
def test_the_built_library_agrees() -> None:
    path = library_path()
    assert path is not None
    assert abi_mismatch(ctypes.CDLL(str(path))) == ""


@pytest.mark.parametrize("which", range(len(C_NAMES)), ids=C_NAMES)
def test_a_library_that_disagrees_is_refused(tmp_path: Path, which: int) -> None:
    name, value = MIRRORED_LAYOUT[which]
    library = build(tmp_path, f"-D{C_NAMES[which]}={value + 1}")
    assert name in abi_mismatch(library)


def test_a_library_built_as_is_agrees(tmp_path: Path) -> None:
    assert abi_mismatch(build(tmp_path)) == ""

