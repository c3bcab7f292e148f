"""`put_many`'s items, checked whole before anything is stored."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar, cast

from tierkv.formats.value import Value, check_value
from tierkv.keys import Key, encode_key

KeyT = TypeVar("KeyT", bound=Key)
ValueT = TypeVar("ValueT", bound=Value)


def checked_pairs(items: Mapping[KeyT, ValueT] | Iterable[tuple[KeyT, ValueT]]
                  ) -> list[tuple[KeyT, ValueT]]:
    """`put_many`'s items as a list of pairs, each key and value checked as `put` checks
    them, all before the first is stored (checked by each put alone, a bad item raised only
    when its turn came, after the items before it were stored)."""
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        what = "put_many takes a mapping or an iterable of (key, value) pairs"
        if isinstance(items, str | bytes | bytearray | memoryview):
            raise TypeError(f"{what}, not a single {type(items).__name__}")
        try:
            listed: list[object] = list(items)
        except TypeError:
            if hasattr(items, "__iter__"):
                raise  # raised while iterating: the iterable's own error
            raise TypeError(f"{what}, not {type(items).__name__}") from None
        pairs = []
        for item in listed:
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"{what}; an item is a {type(item).__name__}"
                                + (f" of {len(item)}" if isinstance(item, tuple) else ""))
            pairs.append(cast("tuple[KeyT, ValueT]", item))
    for key, value in pairs:
        encode_key(key)
        check_value(value)
    return pairs
