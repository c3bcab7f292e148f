"""The NVMe log layout (`tierkv.formats.nvme_layout`): packed entries, padding records and the
scan over them; the superblock's granularity and layout version. Fuzzed with hypothesis."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.errors import CorruptObjectError
from tierkv.formats.header import ObjectHeader, checksum, encode_header
from tierkv.formats.nvme_layout import (
    ENTRY_GRANULARITY,
    LAYOUT_VERSION,
    PADDING,
    PREFIX,
    SUPERBLOCK_SIZE,
    TOMBSTONE,
    ForeignFormatError,
    OlderLayoutError,
    Superblock,
    decode_entry,
    decode_superblock,
    encode_prefix,
    encode_superblock,
    entry_size,
    padding_size,
    scan_entries,
    write_entry,
    write_padding,
    write_region_header,
)
from tierkv.formats.value import ObjectMeta, ValueKind

FAST = settings(max_examples=60, deadline=None)
BLOCK = 4096
GRAIN = ENTRY_GRANULARITY
REGION = 256 << 10
UUID = bytes(range(16))
SEQ = 5


@dataclass(frozen=True, slots=True)
class Placed:
    key: bytes
    offset: int
    length: int
    tombstone: bool
    payload: bytes


def build(ops: list[tuple[int, bool, bool]]) -> tuple[bytearray, list[Placed], list[int]]:
    """A region as the tier writes it: `ops` are (payload size, tombstone, flush after); a flush
    pads to the next block with a padding record. Returns the region, its entries and the
    offsets of its padding records. The buffer starts full of stale bytes (0xA5), as a reused
    buffer may be, except where records were written."""
    region = bytearray(b"\xa5" * REGION)
    view = memoryview(region)
    write_region_header(view, UUID, SEQ, 0, BLOCK)
    used, placed, paddings = BLOCK, [], []
    for n, (size, tombstone, flush) in enumerate(ops):
        name = b"k%d" % n
        payload = b"" if tombstone else os.urandom(size)
        meta = ObjectMeta(ValueKind.BYTES, "", (), len(payload), 1)
        header = encode_header(ObjectHeader(name, meta, checksum(payload)))
        length = entry_size(len(header), len(payload), GRAIN)
        if used + length > REGION:
            break
        write_entry(view, used, UUID, seq=SEQ, flags=TOMBSTONE if tombstone else 0,
                    header=header, payload=payload, size=length)
        placed.append(Placed(name, used, length, tombstone, payload))
        used += length
        pad = padding_size(used, BLOCK)
        if flush and pad:
            write_padding(view, used, UUID, seq=SEQ, size=pad)
            paddings.append(used)
            used += pad
    return region, placed, paddings


OPS = st.lists(st.tuples(st.integers(0, 9000), st.booleans(), st.booleans()), max_size=40)


@FAST
@given(OPS)
def test_scan_finds_exactly_the_packed_entries(ops: list[tuple[int, bool, bool]]) -> None:
    region, placed, paddings = build(ops)
    found = scan_entries(region, UUID, SEQ, BLOCK, GRAIN)
    assert found.corrupt == 0
    assert [(e.key, e.offset, e.length, e.tombstone) for e in found.entries] == [
        (p.key, p.offset, p.length, p.tombstone) for p in placed]
    ends = [p.offset + p.length for p in placed] + [
        at + padding_size(at, BLOCK) for at in paddings]
    assert found.used == max(ends, default=BLOCK)
    assert all(at % GRAIN == 0 for at in paddings)
    for p in placed:
        if not p.tombstone:
            _header, _raw, payload = decode_entry(
                memoryview(region)[p.offset : p.offset + p.length], UUID, SEQ)
            assert bytes(payload) == p.payload


@FAST
@given(OPS, st.integers(BLOCK, REGION - 1), st.integers(1, 255))
def test_a_damaged_byte_loses_at_most_its_entry(ops: list[tuple[int, bool, bool]], at: int,
                                                 mask: int) -> None:
    """A flipped byte anywhere after the region header: the scan never yields an entry that was
    not written (or one of another offset or length); it loses at most the entry holding the
    byte, and counts the loss when it does (unless the byte was in the entry magic)."""
    region, placed, _paddings = build(ops)
    region[at] ^= mask
    found = scan_entries(region, UUID, SEQ, BLOCK, GRAIN)
    written = {(p.key, p.offset, p.length, p.tombstone) for p in placed}
    got = {(e.key, e.offset, e.length, e.tombstone) for e in found.entries if not e.damaged}
    assert got <= written
    hit = [p for p in placed if p.offset <= at < p.offset + p.length]
    # a damaged record is listed only as the one the byte hit, under its own key
    assert {(e.key, e.offset) for e in found.entries if e.damaged} <= {
        (p.key, p.offset) for p in hit}
    assert written - {(p.key, p.offset, p.length, p.tombstone) for p in hit} <= got
    # a prefix without its magic is no entry at all, as before packing: not counted
    if hit and not got >= {(p.key, p.offset, p.length, p.tombstone) for p in hit} \
            and at >= hit[0].offset + len(b"TKVE"):
        assert found.corrupt >= 1


def _padding_case(region: bytearray, at: int, body_len: int, flags: int = PADDING) -> None:
    region[at : at + PREFIX.size] = encode_prefix(UUID, flags, SEQ, body_len)


def test_padding_must_end_on_a_block_boundary() -> None:
    """A checksummed padding record that does not end on a block boundary is damage: counted,
    stepped over granule by granule; the entry after it is still found."""
    region, placed, _ = build([(100, False, False)])
    end = placed[0].offset + placed[0].length
    _padding_case(region, end, padding_size(end, BLOCK) - PREFIX.size - GRAIN)
    region[end + PREFIX.size : BLOCK * 2] = bytes(BLOCK * 2 - end - PREFIX.size)
    tail, more, _ = build([(100, False, False)])
    region[BLOCK * 2 : BLOCK * 3] = tail[BLOCK : BLOCK * 2]
    found = scan_entries(region, UUID, SEQ, BLOCK, GRAIN)
    assert found.corrupt == 1
    assert [e.offset for e in found.entries] == [placed[0].offset, BLOCK * 2]
    assert more[0].key == found.entries[1].key


def test_unknown_flags_are_damage() -> None:
    region, placed, _ = build([(100, False, False), (200, False, False)])
    second = placed[1]
    size = second.length
    region[second.offset : second.offset + PREFIX.size] = encode_prefix(
        UUID, TOMBSTONE | PADDING, SEQ, size - PREFIX.size)
    found = scan_entries(region, UUID, SEQ, BLOCK, GRAIN)
    assert found.corrupt == 1 and [e.key for e in found.entries] == [placed[0].key]


def test_records_of_another_use_are_stale_not_damage() -> None:
    region, placed, _ = build([(100, False, True), (5000, False, False)])
    found = scan_entries(region, UUID, SEQ + 1, BLOCK, GRAIN)
    assert (found.entries, found.corrupt, found.used) == ((), 0, BLOCK)
    assert placed


def test_decode_entry_refuses_padding_and_tombstones() -> None:
    region, placed, paddings = build([(100, False, True), (0, True, True)])
    view = memoryview(region)
    for at in (paddings[0], placed[1].offset):
        with pytest.raises(CorruptObjectError):
            decode_entry(view[at : at + BLOCK], UUID, SEQ)


def test_padding_needs_room_for_its_prefix() -> None:
    with pytest.raises(ValueError):
        write_padding(memoryview(bytearray(BLOCK)), 0, UUID, seq=SEQ, size=PREFIX.size - 1)


# -- superblock ------------------------------------------------------------------------------------
def _sb(*, version: int = LAYOUT_VERSION, granularity: int = ENTRY_GRANULARITY) -> Superblock:
    return Superblock(1 << 20, SUPERBLOCK_SIZE + 8 * (1 << 20), 8, UUID, BLOCK, version=version,
                      granularity=granularity)


def test_superblock_records_the_granularity() -> None:
    sb = _sb()
    assert (sb.version, sb.granularity) == (LAYOUT_VERSION, ENTRY_GRANULARITY)
    assert decode_superblock(encode_superblock(sb)) == sb
    assert decode_superblock(encode_superblock(_sb(granularity=BLOCK))).granularity == BLOCK


@pytest.mark.parametrize("granularity", [0, 16, 48, 96, 2 * BLOCK])
def test_superblock_with_a_bad_granularity_is_damaged(granularity: int) -> None:
    with pytest.raises(CorruptObjectError) as info:
        decode_superblock(encode_superblock(_sb(granularity=granularity)))
    assert not isinstance(info.value, ForeignFormatError)


def test_layout_1_superblock_is_an_older_layout() -> None:
    """Version 1 recorded no granularity (its field was zero flags) and aligned entries to the
    block: it is refused as an older layout, never read with the packed rules."""
    with pytest.raises(OlderLayoutError):
        decode_superblock(encode_superblock(_sb(version=1, granularity=0)))
    with pytest.raises(ForeignFormatError) as info:
        decode_superblock(encode_superblock(_sb(version=LAYOUT_VERSION + 1)))
    assert not isinstance(info.value, OlderLayoutError)
