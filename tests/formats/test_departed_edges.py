"""The record of edges into departed keys (`tierkv.formats.departed_edges`): round trip and
strict decoding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv import CorruptObjectError
from tierkv.formats.departed_edges import (
    MAX_KEY,
    decode_departed_edges,
    encode_departed_edges,
)
from tierkv.keys import MAX_KEY_SIZE, encode_key

names = st.binary(min_size=1, max_size=40)
edges_strategy = st.dictionaries(
    names, st.lists(names, max_size=6, unique=True).map(lambda parents: tuple(sorted(parents))),
    max_size=12)


@given(edges_strategy)
def test_round_trip(edges: dict[bytes, tuple[bytes, ...]]) -> None:
    assert decode_departed_edges(encode_departed_edges(edges)) == edges


@given(edges_strategy, st.data())
def test_every_truncation_is_refused(edges: dict[bytes, tuple[bytes, ...]],
                                     data: st.DataObject) -> None:
    record = encode_departed_edges(edges)
    cut = data.draw(st.integers(min_value=0, max_value=len(record) - 1))
    with pytest.raises(CorruptObjectError):
        decode_departed_edges(record[:cut])


def test_trailing_bytes_a_foreign_magic_and_a_repeated_key_or_parent_are_refused() -> None:
    record = encode_departed_edges({b"b": (b"a",)})
    with pytest.raises(CorruptObjectError, match="after its last entry"):
        decode_departed_edges(record + b"\0")
    with pytest.raises(CorruptObjectError, match="magic"):
        decode_departed_edges(b"TKTB" + record[4:])  # the tombstones' magic
    head, entry = record[:8], record[8:]
    doubled = head[:4] + (2).to_bytes(4, "little") + entry + entry
    with pytest.raises(CorruptObjectError, match="key listed twice"):
        decode_departed_edges(doubled)
    parent = (1).to_bytes(2, "little") + b"a"
    twice = (head[:4] + (1).to_bytes(4, "little") + (1).to_bytes(2, "little") + b"b"
             + (2).to_bytes(2, "little") + parent + parent)
    with pytest.raises(CorruptObjectError, match="parent listed twice"):
        decode_departed_edges(twice)


def test_parents_are_written_once_each_in_order() -> None:
    assert (decode_departed_edges(encode_departed_edges({b"b": [b"z", b"a", b"z"]}))
            == {b"b": (b"a", b"z")})


def test_the_longest_key_the_engine_makes_fits_and_a_longer_one_is_refused() -> None:
    longest = encode_key(b"k" * (MAX_KEY_SIZE - 1))
    assert decode_departed_edges(encode_departed_edges({longest: (longest[:-1],)})) == {
        longest: (longest[:-1],)}
    with pytest.raises(ValueError, match="longer than"):
        encode_departed_edges({b"b": (b"k" * (MAX_KEY + 1),)})
