"""What a put records beside its value, and `put_many`'s items, checked whole before anything
is stored, then put in order along their chains."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar, cast

from tierkv.formats.header import check_header
from tierkv.formats.value import ObjectMeta, Value, value_meta
from tierkv.keys import BlockKey, Key, encode_key, key_list, version_key

KeyT = TypeVar("KeyT", bound=Key)
ValueT = TypeVar("ValueT", bound=Value)


def put_parents(key: Key, parents: Iterable[Key]) -> tuple[bytes, ...]:
    """The parents a put of `key` records: those named, then a block's model version (last:
    the first parent names the prefix), which `invalidate_model` removes it under."""
    derived = [encode_key(parent) for parent in key_list(parents, "put's parents")]
    if isinstance(key, BlockKey) and key.model is not None:
        derived.append(version_key(key.model))
    return tuple(derived)


def checked_puts(items: Mapping[KeyT, ValueT] | Iterable[tuple[KeyT, ValueT]],
                 fits: Callable[[bytes, ObjectMeta], None] = lambda _key, _meta: None
                 ) -> list[tuple[KeyT, ValueT, tuple[Key, ...]]]:
    """`put_many`'s puts: each item with the parent it is linked to (`Engine.put_many`), a
    `BlockKey` equal to one before it in the call left out, every key, value and header
    checked as `put` checks them, all before the first is stored (checked by each put alone,
    a bad item raised only when its turn came, after the items before it were stored).

    An equal `BlockKey` names an equal token prefix, so equal blocks: put again, it overwrote
    the first and removed what derives from it, the blocks of every other prompt of the call
    that share the prefix (two prompts with a common system prompt lost their own blocks)."""
    puts: list[tuple[KeyT, ValueT, tuple[Key, ...]]] = []
    blocks: dict[tuple[bytes, float], BlockKey] = {}
    for key, value in _pairs(items):
        raw = encode_key(key)
        parent = None
        if isinstance(key, BlockKey):
            if blocks.get((key.digest, key.rope_theta)) == key:
                value_meta(value)
                continue
            if key.parent_digest is not None:
                parent = blocks.get((key.parent_digest, key.rope_theta))
            blocks[key.digest, key.rope_theta] = key
        parents: tuple[Key, ...] = () if parent is None else (parent,)
        meta = value_meta(value, parents=put_parents(key, parents))
        check_header(raw, meta)
        fits(raw, meta)  # the engine's: a header the persistent tiers have room for
        puts.append((key, value, parents))
    return puts


def _pairs(items: Mapping[KeyT, ValueT] | Iterable[tuple[KeyT, ValueT]]
           ) -> list[tuple[KeyT, ValueT]]:
    """`put_many`'s items as a list of pairs; `TypeError` for what is not one."""
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
    return pairs


async def put_chains(puts: list[tuple[KeyT, ValueT, tuple[Key, ...]]],
                     put: Callable[[KeyT, ValueT, tuple[Key, ...]], Awaitable[None]],
                     stored: Callable[[bytes], bool], linked: Callable[[bytes], bool],
                     remove: Callable[[KeyT], Awaitable[int]]) -> int:
    """Put `puts` (`checked_puts`) in order with `put`; how many were stored. A block is put
    only below a parent block of the call that was stored (`stored`: the key holds a value)
    and is still linked to what it was linked to when it was, and is removed again (`remove`,
    an invalidation) if the parent was cut from that while the block was put: the block
    derives from a value that was removed, and linked to the cut parent alone it would outlive
    a new value of the chain's first block. An invalidation of the parent (another engine's,
    applied here by the fleet's follower) ran between two puts of the call and did just that.
    A parent merely overwritten meanwhile (another prompt putting the same block) keeps its
    links (`linked`: the key has parents in the DAG); one that left the cache childless loses
    them, and the blocks below it (orphans, worth nothing to a prefix lookup) go too."""
    done: dict[bytes, bool] = {}  # the blocks stored, each: whether it had parents then
    count = 0
    for key, value, parents in puts:
        above = [encode_key(parent) for parent in parents]
        if any(parent not in done or (done[parent] and not linked(parent)) for parent in above):
            continue
        await put(key, value, parents)
        if any(done[parent] and not linked(parent) for parent in above):
            await remove(key)
            continue
        raw = encode_key(key)
        if stored(raw):  # else the put ended invalidated, or its value left already
            done[raw] = linked(raw)
            count += 1
    return count
