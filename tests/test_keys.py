"""Chained block keys and the canonical key encoding (`tierkv.keys`)."""

from __future__ import annotations

import math
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tierkv
from tierkv import BlockKey, CorruptObjectError, LimitExceededError, block_keys
from tierkv.keys import DIGEST_SIZE, MAX_KEY_SIZE, Key, decode_key, encode_key

MODEL = "llama-3-8b@rev1"
THETA = 500000.0

tokens = st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=64)
block_sizes = st.integers(min_value=1, max_value=8)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
digests = st.binary(min_size=DIGEST_SIZE, max_size=DIGEST_SIZE)
block_key_values = st.builds(
    BlockKey, digests, st.integers(min_value=0, max_value=2**64 - 1), finite_floats
)
any_keys: st.SearchStrategy[Key] = st.one_of(block_key_values, st.binary(), st.text())

FAST = settings(max_examples=60, deadline=None)


def _keys(
    token_ids: list[int],
    block_size: int,
    *,
    model: str = MODEL,
    rope_theta: float = THETA,
    namespace: bytes = b"",
) -> list[BlockKey]:
    return block_keys(
        token_ids, block_size=block_size, model=model, rope_theta=rope_theta, namespace=namespace
    )


@FAST
@given(tokens, block_sizes)
def test_one_key_per_full_block_and_no_key_for_the_tail(token_ids: list[int], size: int) -> None:
    keys = _keys(token_ids, size)
    assert len(keys) == len(token_ids) // size
    assert [k.context_length for k in keys] == [size * (i + 1) for i in range(len(keys))]
    assert all(len(k.digest) == DIGEST_SIZE and k.rope_theta == THETA for k in keys)
    assert len({k.digest for k in keys}) == len(keys)


@FAST
@given(tokens, tokens, block_sizes)
def test_equal_prefixes_give_equal_keys(prefix: list[int], tail: list[int], size: int) -> None:
    full = _keys(prefix + tail, size)
    alone = _keys(prefix, size)
    assert full[: len(alone)] == alone


@FAST
@given(tokens, block_sizes, st.binary(), st.binary())
def test_namespace_changes_every_key(token_ids: list[int], size: int, a: bytes, b: bytes) -> None:
    assume(a != b)
    _assert_all_differ(_keys(token_ids, size, namespace=a), _keys(token_ids, size, namespace=b))


@FAST
@given(tokens, block_sizes, st.text(), st.text())
def test_model_changes_every_key(token_ids: list[int], size: int, a: str, b: str) -> None:
    assume(a != b)
    _assert_all_differ(_keys(token_ids, size, model=a), _keys(token_ids, size, model=b))


@FAST
@given(tokens, block_sizes, finite_floats, finite_floats)
def test_rope_theta_changes_every_key(token_ids: list[int], size: int, a: float, b: float) -> None:
    assume(a != b)
    _assert_all_differ(_keys(token_ids, size, rope_theta=a), _keys(token_ids, size, rope_theta=b))


def _assert_all_differ(left: list[BlockKey], right: list[BlockKey]) -> None:
    assert len(left) == len(right)
    for one, other in zip(left, right, strict=True):
        assert one.digest != other.digest
        assert one != other


@FAST
@given(st.data(), tokens.filter(bool), block_sizes)
def test_changing_token_i_changes_keys_from_its_block_on(
    data: st.DataObject, token_ids: list[int], size: int
) -> None:
    index = data.draw(st.integers(min_value=0, max_value=len(token_ids) - 1))
    replacement = data.draw(st.integers(min_value=-(2**63), max_value=2**63 - 1))
    assume(replacement != token_ids[index])
    changed = list(token_ids)
    changed[index] = replacement
    before, after = _keys(token_ids, size), _keys(changed, size)
    first = index // size
    assert before[:first] == after[:first]
    for one, other in zip(before[first:], after[first:], strict=True):
        assert one.digest != other.digest


def test_block_boundaries_are_part_of_the_digest() -> None:
    # The same tokens cut at a different block size must not collide with a shorter chain.
    assert _keys([1, 2, 3, 4], 2)[1].digest != _keys([1, 2, 3, 4], 4)[0].digest
    assert _keys([1, 2, 3, 4], 2)[0].digest != _keys([1, 2], 1)[1].digest


def test_namespace_and_model_framing_do_not_collide() -> None:
    # "ab"+"c" and "a"+"bc" would hash alike without length framing.
    left = block_keys([7], block_size=1, model="bc", rope_theta=1.0, namespace=b"a")
    right = block_keys([7], block_size=1, model="c", rope_theta=1.0, namespace=b"ab")
    assert left[0].digest != right[0].digest


def test_block_keys_is_deterministic_and_accepts_plain_int_theta() -> None:
    first = block_keys(list(range(10)), block_size=4, model=MODEL, rope_theta=10000)
    second = block_keys(tuple(range(10)), block_size=4, model=MODEL, rope_theta=10000.0)
    assert first == second
    assert len(first) == 2
    assert isinstance(first[0].rope_theta, float)


@pytest.mark.parametrize("size", [0, -1])
def test_block_size_must_be_positive(size: int) -> None:
    with pytest.raises(ValueError):
        block_keys([1, 2, 3], block_size=size, model=MODEL, rope_theta=THETA)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"block_size": True}, "block_size is an int, not bool"),
    ({"block_size": 4.0}, "block_size is an int, not float"),
    ({"block_size": "4"}, "block_size is an int, not str"),
    ({"namespace": "tenant"}, "namespace is bytes, not str"),
    ({"namespace": None}, "namespace is bytes, not NoneType"),
])
def test_arguments_of_the_wrong_type_are_named(arguments: dict[str, object], message: str
                                                ) -> None:
    call: dict[str, Any] = {"block_size": 4, "model": MODEL, "rope_theta": THETA, **arguments}
    with pytest.raises(TypeError, match=message):
        block_keys([1, 2, 3, 4], **call)


def test_a_numpy_block_size_and_a_bytearray_namespace_are_taken() -> None:
    expected = block_keys([1, 2, 3, 4], block_size=4, model=MODEL, rope_theta=THETA,
                          namespace=b"t")
    assert block_keys([1, 2, 3, 4], block_size=np.int64(4), model=MODEL,  # type: ignore[arg-type]
                      rope_theta=THETA, namespace=bytearray(b"t")) == expected


def test_empty_and_short_inputs_have_no_keys() -> None:
    assert block_keys([], block_size=4, model=MODEL, rope_theta=THETA) == []
    assert block_keys([1, 2, 3], block_size=4, model=MODEL, rope_theta=THETA) == []


@FAST
@given(any_keys)
def test_encode_decode_round_trip(key: Key) -> None:
    raw = encode_key(key)
    decoded = decode_key(raw)
    assert type(decoded) is type(key)
    assert decoded == key
    assert encode_key(decoded) == raw


@FAST
@given(st.binary())
def test_bytes_like_keys_encode_as_bytes(data: bytes) -> None:
    raw = encode_key(data)
    # Accepted at runtime although `Key` names only bytes: a buffer is as good a key.
    assert encode_key(bytearray(data)) == raw  # type: ignore[arg-type]
    assert encode_key(memoryview(data)) == raw  # type: ignore[arg-type]
    assert decode_key(raw) == data


@FAST
@given(st.text())
def test_bytes_and_str_keys_are_separate_domains(text: str) -> None:
    assert encode_key(text) != encode_key(text.encode())


def test_domain_separation_of_equal_looking_keys() -> None:
    digest = bytes(range(DIGEST_SIZE))
    block = BlockKey(digest, 256, THETA)
    encodings = {encode_key(b"a"), encode_key("a"), encode_key(block), encode_key(digest)}
    assert len(encodings) == 4
    assert decode_key(encode_key(b"a")) == b"a"
    assert decode_key(encode_key("a")) == "a"


def test_empty_bytes_and_str_keys_round_trip() -> None:
    assert decode_key(encode_key(b"")) == b""
    assert decode_key(encode_key("")) == ""


@pytest.mark.parametrize("key", [42, 1.5, None, ("a",), [b"a"]])
def test_encode_key_refuses_other_types(key: object) -> None:
    with pytest.raises(TypeError):
        encode_key(key)  # type: ignore[arg-type]


# Mostly bytes that start with a real tag, some of exactly a block key's encoded length.
key_like_bytes = st.one_of(
    st.binary(max_size=40),
    st.tuples(st.integers(0, 4), st.binary(max_size=40)).map(lambda t: bytes([t[0]]) + t[1]),
    st.binary(min_size=DIGEST_SIZE + 16, max_size=DIGEST_SIZE + 16).map(lambda b: b"\x01" + b),
)


@settings(max_examples=300, deadline=None)
@given(key_like_bytes)
def test_decode_key_of_arbitrary_bytes_round_trips_or_raises(raw: bytes) -> None:
    try:
        key = decode_key(raw)
    except CorruptObjectError:
        return
    assert encode_key(key) == raw


@FAST
@given(digests, st.integers(min_value=0, max_value=2**64 - 1), finite_floats)
def test_decode_key_of_block_shaped_bytes(digest: bytes, length: int, theta: float) -> None:
    raw = b"\x01" + digest + struct.pack("<Qd", length, theta + 0.0)  # -0.0: see below
    assert decode_key(raw) == BlockKey(digest, length, theta)


@pytest.mark.parametrize(("a", "b"), [(0.0, -0.0), (0, -0.0), (2**53, 2**53 + 1), (10, 10.0)])
def test_equal_block_keys_encode_equally_and_unequal_ones_differently(
    a: float, b: float
) -> None:
    """The encoding is the object's identity: two keys address one object exactly when they
    are equal (and hash alike). Of these pairs Python compares some equal and some not; the
    encoding's float64 cannot tell them apart, so the keys are equal."""
    digest = bytes(range(DIGEST_SIZE))
    left, right = BlockKey(digest, 1, a), BlockKey(digest, 1, b)
    assert left == right and hash(left) == hash(right)
    assert encode_key(left) == encode_key(right)
    other = BlockKey(digest, 1, 1.0)
    assert other != left and encode_key(other) != encode_key(left)
    assert block_keys([1, 2], block_size=2, model=MODEL, rope_theta=a) == block_keys(
        [1, 2], block_size=2, model=MODEL, rope_theta=b)


def test_decode_key_refuses_the_encoding_of_negative_zero_theta() -> None:
    # no key encodes to it, so decoding it would not round trip
    raw = b"\x01" + bytes(DIGEST_SIZE) + struct.pack("<Qd", 1, -0.0)
    with pytest.raises(CorruptObjectError):
        decode_key(raw)


async def test_equal_block_keys_address_one_object() -> None:
    digest = bytes(range(DIGEST_SIZE))
    l1 = {"name": "l1", "kind": "gpu", "device": "cpu", "capacity": "4MiB", "slot_size": "1MiB"}
    async with tierkv.open({"tiers": [l1]}) as kv:
        await kv.put(BlockKey(digest, 1, 0.0), b"zero")
        assert await kv.get(BlockKey(digest, 1, -0.0)) == b"zero"
        await kv.put(BlockKey(digest, 1, -0.0), b"again")
        assert kv.stats()["engine"]["objects"] == 1


@pytest.mark.parametrize("theta", [math.nan, math.inf, -math.inf])
def test_decode_key_refuses_non_finite_theta(theta: float) -> None:
    raw = b"\x01" + bytes(DIGEST_SIZE) + struct.pack("<Qd", 1, theta)
    with pytest.raises(CorruptObjectError):
        decode_key(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x00abc",
        b"\x04",
        b"\xff" * 3,
        b"\x03\xff\xfe",  # a str key that is not UTF-8
        b"\x03\xed\xa0\x80",  # a UTF-8 encoded surrogate
        b"\x01" + bytes(DIGEST_SIZE),  # a block key without its tail
        b"\x01" + bytes(DIGEST_SIZE + 16 + 1),  # one byte too many
    ],
)
def test_decode_key_refuses_malformed_encodings(raw: bytes) -> None:
    with pytest.raises(CorruptObjectError):
        decode_key(raw)


@pytest.mark.parametrize("digest", [b"", b"x" * (DIGEST_SIZE - 1), b"x" * (DIGEST_SIZE + 1)])
def test_block_key_refuses_digest_of_wrong_length(digest: bytes) -> None:
    with pytest.raises(ValueError):
        BlockKey(digest, 1, THETA)


def test_block_key_refuses_digest_that_is_not_bytes() -> None:
    with pytest.raises(ValueError):
        BlockKey(bytearray(DIGEST_SIZE), 1, THETA)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockKey("x" * DIGEST_SIZE, 1, THETA)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [1.0, "1", True, None])
def test_block_key_refuses_context_length_that_is_not_an_int(length: object) -> None:
    with pytest.raises(TypeError):
        BlockKey(bytes(DIGEST_SIZE), length, THETA)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [-1, 2**64])
def test_block_key_refuses_context_length_out_of_range(length: int) -> None:
    with pytest.raises(ValueError):
        BlockKey(bytes(DIGEST_SIZE), length, THETA)


@pytest.mark.parametrize("theta", [math.nan, math.inf, -math.inf, "1.0", None])
def test_block_key_refuses_theta_that_is_not_a_finite_number(theta: object) -> None:
    with pytest.raises(ValueError):
        BlockKey(bytes(DIGEST_SIZE), 1, theta)  # type: ignore[arg-type]


@pytest.mark.parametrize("theta", [10**400, -(10**400), True, False])
def test_block_key_refuses_theta_too_large_for_a_float_or_bool(theta: object) -> None:
    with pytest.raises(ValueError):
        BlockKey(bytes(DIGEST_SIZE), 1, theta)  # type: ignore[arg-type]


def test_block_key_accepts_int_theta_that_fits_a_float() -> None:
    assert decode_key(encode_key(BlockKey(bytes(DIGEST_SIZE), 1, 10**300))) == BlockKey(
        bytes(DIGEST_SIZE), 1, float(10**300)
    )


def test_encode_key_refuses_keys_over_the_size_limit() -> None:
    longest = MAX_KEY_SIZE - 1  # one byte goes to the domain tag
    assert len(encode_key(b"k" * longest)) == MAX_KEY_SIZE
    assert len(encode_key("k" * longest)) == MAX_KEY_SIZE
    with pytest.raises(LimitExceededError) as info:
        encode_key(b"k" * (longest + 1))
    assert (info.value.maximum, info.value.actual) == (longest, longest + 1)
    with pytest.raises(ValueError):
        encode_key("\u00e9" * (longest // 2 + 1))  # the limit counts UTF-8 bytes


def test_block_keys_refuses_a_model_too_long_to_be_a_key() -> None:
    # a put hangs the block under the model version's key, a parent in its header
    longest = "m" * (MAX_KEY_SIZE - 1)
    assert block_keys([1, 2], block_size=2, model=longest, rope_theta=THETA)
    with pytest.raises(LimitExceededError):
        block_keys([1, 2], block_size=2, model=longest + "m", rope_theta=THETA)


def test_block_key_is_hashable_and_frozen() -> None:
    key = BlockKey(bytes(DIGEST_SIZE), 4, THETA)
    assert {key: 1}[BlockKey(bytes(DIGEST_SIZE), 4, THETA)] == 1
    with pytest.raises(AttributeError):
        key.context_length = 5  # type: ignore[misc]


# -- arguments with no canonical form: one clear error, not struct.error or UnicodeError --------
@pytest.mark.parametrize("token", [2**63, -(2**63) - 1, 2**200])
@pytest.mark.parametrize("position", [0, 6])
def test_block_keys_refuses_token_ids_outside_64_bits(token: int, position: int) -> None:
    token_ids = list(range(8))
    token_ids[position] = token
    with pytest.raises(ValueError):
        block_keys(token_ids, block_size=4, model=MODEL, rope_theta=THETA)


@pytest.mark.parametrize("token", ["7", 1.5, None, b"\x01"])
def test_block_keys_refuses_token_ids_that_are_not_ints(token: object) -> None:
    with pytest.raises(TypeError):
        block_keys([1, token, 3, 4], block_size=2, model=MODEL,  # type: ignore[list-item]
                   rope_theta=THETA)


def test_block_keys_accepts_the_ends_of_the_64_bit_range() -> None:
    keys = block_keys([2**63 - 1, -(2**63)], block_size=2, model=MODEL, rope_theta=THETA)
    assert len(keys) == 1


#: str values with no UTF-8 form: lone surrogates (what surrogateescape decoding and broken JSON
#: escapes produce), also a high and a low one side by side (a pair only in UTF-16)
NOT_UTF8 = ["\ud800", "key-\udcff", "\udfff\ud800", "\ud83d\ude00"]


def _not_utf8_error(info: pytest.ExceptionInfo[ValueError]) -> None:
    # UnicodeEncodeError is a ValueError too: the point is the plain one about the argument
    assert not isinstance(info.value, UnicodeError), repr(info.value)


@pytest.mark.parametrize("text", NOT_UTF8)
def test_encode_key_refuses_a_str_without_a_utf8_form(text: str) -> None:
    with pytest.raises(ValueError) as info:
        encode_key(text)
    _not_utf8_error(info)


@pytest.mark.parametrize("text", NOT_UTF8)
def test_block_keys_refuses_a_model_without_a_utf8_form(text: str) -> None:
    with pytest.raises(ValueError) as info:
        block_keys([1, 2], block_size=2, model=text, rope_theta=THETA)
    _not_utf8_error(info)


@pytest.mark.parametrize("model", [b"m@1", 1, ["m@1"]])
def test_a_model_name_that_is_not_a_str_is_a_type_error(model: object) -> None:
    with pytest.raises(TypeError):
        block_keys([1, 2], block_size=2, model=model, rope_theta=THETA)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BlockKey(bytes(DIGEST_SIZE), 2, THETA, model)  # type: ignore[arg-type]


async def test_invalidate_model_of_a_name_that_is_not_a_str_is_a_type_error() -> None:
    l1 = {"name": "l1", "kind": "gpu", "device": "cpu", "capacity": "4MiB", "slot_size": "1MiB"}
    async with tierkv.open({"tiers": [l1]}) as kv:
        await kv.put_many([(key, b"v") for key in _keys(list(range(8)), 4, model="m@1")])
        with pytest.raises(TypeError):
            await kv.invalidate_model(b"m@1")  # type: ignore[arg-type]
        assert kv.stats()["engine"]["objects"] == 2
        assert await kv.invalidate_model("m@1") == 2


async def test_every_engine_key_argument_refuses_a_str_without_a_utf8_form() -> None:
    bad = NOT_UTF8[0]
    l1 = {"name": "l1", "kind": "gpu", "device": "cpu", "capacity": "4MiB", "slot_size": "1MiB"}
    async with tierkv.open({"tiers": [l1]}) as kv:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: kv.put(bad, b"v"),
            lambda: kv.put("ok", b"v", parents=[bad]),
            lambda: kv.put_many([("ok", b"v"), (bad, b"v")]),
            lambda: kv.get(bad),
            lambda: kv.get_many(["ok", bad]),
            lambda: kv.contains(bad),
            lambda: kv.locate(bad),
            lambda: kv.delete(bad),
            lambda: kv.invalidate(bad),
        ]
        for call in calls:
            with pytest.raises(ValueError) as info:
                await call()
            _not_utf8_error(info)
        with pytest.raises(ValueError) as info:
            async with kv.pin(bad):
                pass
        _not_utf8_error(info)
        assert await kv.locate("ok") is None  # put_many checks every pair before it stores
        assert kv.stats()["engine"]["objects"] == 0
