"""The record of refused deletes (`tierkv.formats.tombstones`): round trip and strict decoding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv import CorruptObjectError, LimitExceededError
from tierkv.formats.tombstones import MAX_KEY, decode_tombstones, encode_tombstones
from tierkv.keys import MAX_KEY_SIZE, encode_key

bounds_strategy = st.dictionaries(st.binary(min_size=1, max_size=64),
                                  st.integers(min_value=0, max_value=2**64 - 1), max_size=20)


@given(bounds_strategy)
def test_round_trip(bounds: dict[bytes, int]) -> None:
    assert decode_tombstones(encode_tombstones(bounds)) == bounds


@given(bounds_strategy, st.data())
def test_every_truncation_is_refused(bounds: dict[bytes, int], data: st.DataObject) -> None:
    record = encode_tombstones(bounds)
    cut = data.draw(st.integers(min_value=0, max_value=len(record) - 1))
    with pytest.raises(CorruptObjectError):
        decode_tombstones(record[:cut])


def test_trailing_bytes_a_foreign_magic_and_a_repeated_key_are_refused() -> None:
    record = encode_tombstones({b"a": 1, b"b": 2})
    with pytest.raises(CorruptObjectError, match="after its last entry"):
        decode_tombstones(record + b"\0")
    with pytest.raises(CorruptObjectError, match="magic"):
        decode_tombstones(b"XXXX" + record[4:])
    twice = encode_tombstones({b"a": 1})
    head, entry = twice[:8], twice[8:]
    doubled = b"TKTB" + (2).to_bytes(4, "little") + entry + entry
    assert head[:4] == b"TKTB"
    with pytest.raises(CorruptObjectError, match="twice"):
        decode_tombstones(doubled)


def test_a_key_too_long_for_the_layout_is_refused_when_encoding() -> None:
    with pytest.raises(ValueError, match="longer than"):
        encode_tombstones({b"k" * (MAX_KEY + 1): 1})


def test_the_longest_key_the_engine_makes_fits_a_record() -> None:
    """A delete a device refuses is recorded by its canonical key: any key `encode_key`
    accepts must fit, or every flush would fail on it."""
    longest = encode_key(b"k" * (MAX_KEY_SIZE - 1))  # one byte goes to the domain tag
    assert decode_tombstones(encode_tombstones({longest: 7})) == {longest: 7}
    with pytest.raises(LimitExceededError):
        encode_key(b"k" * MAX_KEY_SIZE)


def test_a_record_is_read_only_under_its_own_magic() -> None:
    from tierkv.formats.tombstones import UNPUBLISHED_MAGIC

    keys = encode_tombstones({b"a": 0, b"b": 0}, UNPUBLISHED_MAGIC)
    assert decode_tombstones(keys, UNPUBLISHED_MAGIC) == {b"a": 0, b"b": 0}
    with pytest.raises(CorruptObjectError, match="magic"):
        decode_tombstones(keys)  # never taken for tombstones, nor tombstones for keys
    with pytest.raises(CorruptObjectError, match="magic"):
        decode_tombstones(encode_tombstones({b"a": 1}), UNPUBLISHED_MAGIC)
