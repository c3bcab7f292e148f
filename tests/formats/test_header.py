"""The object header (`tierkv.formats.header`): round trip, strict decoding, fuzzing."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import CorruptObjectError, LimitExceededError
from tierkv.formats.header import (
    FORMAT_VERSION,
    MAGIC,
    MAX_BODY,
    MAX_KEY,
    MAX_PARENTS,
    PREFIX,
    ObjectHeader,
    check_header,
    checksum,
    decode_header,
    encode_header,
    encode_header_parts,
    header_length,
    verify_payload,
)
from tierkv.formats.value import DTYPES, MAX_DIMS, ObjectMeta, ValueKind

FAST = settings(max_examples=50, deadline=None)
U64 = st.integers(min_value=0, max_value=2**64 - 1)
ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}


@st.composite
def metas(draw: st.DrawFn) -> ObjectMeta:
    parents = tuple(draw(st.lists(st.binary(min_size=1, max_size=40), max_size=5)))
    generation = draw(U64)
    if draw(st.booleans()):
        return ObjectMeta(ValueKind.BYTES, "", (), draw(U64), generation, parents)
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    # Many small dims or a few large ones; the product times the item size stays below 2**64.
    shape = draw(
        st.one_of(
            st.lists(st.integers(0, 3), max_size=MAX_DIMS),
            st.lists(st.integers(0, 1000), max_size=6),
        )
    )
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    return ObjectMeta(ValueKind.TENSOR, dtype, tuple(shape), nbytes, generation, parents)


headers = st.builds(ObjectHeader, st.binary(min_size=1, max_size=64), metas(), U64, U64)


def _fields(header: ObjectHeader) -> list[Any]:
    meta = header.meta
    return [
        header.key,
        int(meta.kind),
        meta.dtype,
        list(meta.shape),
        meta.nbytes,
        header.payload_checksum,
        list(meta.parents),
        meta.generation,
        header.flags,
    ]


def _frame(body: bytes, *, magic: bytes = MAGIC, version: int = FORMAT_VERSION) -> bytes:
    """A prefix with a valid checksum in front of `body`, as bit rot with luck would leave it."""
    return PREFIX.pack(magic, version, 0, len(body), checksum(body)) + body


def _pack(fields: Any) -> bytes:
    packed = msgpack.packb(fields, use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


def _valid() -> ObjectHeader:
    meta = ObjectMeta(ValueKind.TENSOR, "float16", (2, 3), 12, 5, (b"\x02parent",))
    return ObjectHeader(b"\x02key", meta, checksum(b"x" * 12), flags=1)


@FAST
@given(headers, st.binary(max_size=16))
def test_round_trip(header: ObjectHeader, trailing: bytes) -> None:
    raw = encode_header(header)
    assert raw[:4] == MAGIC
    assert header_length(raw) == len(raw)
    for buf in (raw + trailing, bytearray(raw + trailing), memoryview(raw + trailing)):
        assert decode_header(buf) == (header, len(raw))


def test_round_trip_of_the_extremes() -> None:
    meta = ObjectMeta(ValueKind.TENSOR, "bool", (1,) * MAX_DIMS, 1, 2**64 - 1, (b"p",) * 100)
    header = ObjectHeader(b"k" * MAX_KEY, meta, 2**64 - 1, 2**64 - 1)
    raw = encode_header(header)
    assert decode_header(raw) == (header, len(raw))


def test_round_trip_of_a_zero_dim_tensor_and_empty_bytes() -> None:
    for meta in (
        ObjectMeta(ValueKind.TENSOR, "float64", (), 8),
        ObjectMeta(ValueKind.BYTES, "", (), 0),
    ):
        header = ObjectHeader(b"\x03k", meta, 0)
        assert decode_header(encode_header(header))[0] == header


@settings(max_examples=25, deadline=None)
@given(headers)
def test_every_truncation_is_corrupt(header: ObjectHeader) -> None:
    raw = encode_header(header)
    for end in range(len(raw)):
        with pytest.raises(CorruptObjectError):
            decode_header(raw[:end])


@settings(max_examples=25, deadline=None)
@given(headers, st.integers(min_value=1, max_value=255), st.binary(max_size=64))
def test_every_single_byte_flip_is_corrupt(header: ObjectHeader, mask: int, tail: bytes) -> None:
    raw = encode_header(header)
    for position in range(len(raw)):
        flipped = bytearray(raw + tail)
        flipped[position] ^= mask
        # A flip never decodes: the prefix is checked field by field and the body is checksummed.
        with pytest.raises(CorruptObjectError):
            decode_header(flipped)


@pytest.mark.parametrize("reserved", [1, 0x8000, 0xFFFF])
def test_reserved_prefix_bits_are_checked(reserved: int) -> None:
    # The prefix is outside the body checksum, so the reserved field must be checked by value.
    body = _body()
    raw = PREFIX.pack(MAGIC, FORMAT_VERSION, reserved, len(body), checksum(body)) + body
    with pytest.raises(CorruptObjectError):
        decode_header(raw)
    with pytest.raises(CorruptObjectError):
        header_length(raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptObjectError):
        decode_header(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bodies_behind_a_valid_prefix_are_corrupt(body: bytes) -> None:
    with pytest.raises(CorruptObjectError):
        decode_header(_frame(body))


msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(headers, st.data())
def test_bodies_with_replaced_fields_never_decode_to_wrong_data(
    header: ObjectHeader, data: st.DataObject
) -> None:
    fields = _fields(header)
    for index in data.draw(st.sets(st.integers(0, len(fields) - 1), min_size=1, max_size=3)):
        fields[index] = data.draw(msgpack_values)
    raw = _frame(_pack(fields))
    try:
        decoded, length = decode_header(raw)
    except CorruptObjectError:
        return
    # Accepted only if every field was valid after all: it must then be exactly what was packed.
    assert length == len(raw)
    assert encode_header(decoded) == raw


def _body(**changes: Any) -> bytes:
    fields = _fields(_valid())
    names = ["key", "kind", "dtype", "shape", "length", "sum", "parents", "generation", "flags"]
    for name, value in changes.items():
        fields[names.index(name)] = value
    return _pack(fields)


def test_hand_built_valid_body_decodes() -> None:
    # The control for the cases below: the same construction without a defect is accepted.
    assert decode_header(_frame(_body()))[0] == _valid()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_body(key="\x02key"), id="key-str"),
        pytest.param(_body(key=b""), id="key-empty"),
        pytest.param(_body(key=None), id="key-nil"),
        pytest.param(_body(kind="tensor"), id="kind-str"),
        pytest.param(_body(kind=True), id="kind-bool"),
        pytest.param(_body(kind=2.0), id="kind-float"),
        pytest.param(_body(dtype=b"float16"), id="dtype-bin"),
        pytest.param(_body(shape=["2", "3"]), id="shape-str"),
        pytest.param(_body(shape=[2, -3]), id="shape-negative"),
        pytest.param(_body(shape=[2.0, 3]), id="shape-float"),
        pytest.param(_body(shape={"a": 1}), id="shape-map"),
        pytest.param(_body(shape=6), id="shape-int"),
        pytest.param(_body(length=-12), id="length-negative"),
        pytest.param(_body(length="12"), id="length-str"),
        pytest.param(_body(sum=1.5), id="checksum-float"),
        pytest.param(_body(sum=-1), id="checksum-negative"),
        pytest.param(_body(parents=["\x02parent"]), id="parents-str"),
        pytest.param(_body(parents=[b""]), id="parents-empty-key"),
        pytest.param(_body(parents=b"\x02parent"), id="parents-bin"),
        pytest.param(_body(parents=[b"p"] * (MAX_PARENTS + 1)), id="parents-too-many"),
        pytest.param(_body(generation=False), id="generation-bool"),
        pytest.param(_body(generation=-1), id="generation-negative"),
        pytest.param(_body(flags=None), id="flags-nil"),
        pytest.param(_body(key=b"k" * (MAX_KEY + 1)), id="key-too-long"),
    ],
)
def test_wrong_field_types_are_corrupt(body: bytes) -> None:
    with pytest.raises(CorruptObjectError):
        decode_header(_frame(body))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_pack(_fields(_valid())[:8]), id="8-fields"),
        pytest.param(_pack([*_fields(_valid()), 0]), id="10-fields"),
        pytest.param(_pack([]), id="0-fields"),
        pytest.param(_pack(dict(enumerate(_fields(_valid())))), id="int-keyed-map"),
        pytest.param(_pack({str(i): f for i, f in enumerate(_fields(_valid()))}), id="map"),
        pytest.param(_pack(7), id="int"),
        pytest.param(_pack(_fields(_valid())) + b"\xc0", id="trailing-data"),
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="reserved-msgpack-byte"),
        pytest.param(b"\x99", id="array-header-without-items"),
        pytest.param(b"\x91" * 5000 + b"\xc0", id="nested-too-deep"),
        pytest.param(b"\xd4\xff\x00", id="bad-timestamp-ext"),
        pytest.param(_pack(msgpack.ExtType(5, b"x")), id="ext-type"),
        pytest.param(b"\xdb\xff\xff\xff\xff", id="str-longer-than-body"),
    ],
)
def test_wrong_body_structure_is_corrupt(body: bytes) -> None:
    with pytest.raises(CorruptObjectError):
        decode_header(_frame(body))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_body(length=20), id="shape-takes-12-bytes-not-20"),
        pytest.param(_body(shape=[2, 4]), id="shape-takes-16-bytes-not-12"),
        pytest.param(_body(shape=[1] * (MAX_DIMS + 1), length=2), id="too-many-dims"),
        pytest.param(_body(dtype="float128"), id="unknown-dtype"),
        pytest.param(_body(dtype=""), id="tensor-without-dtype"),
        pytest.param(_body(dtype="__class__"), id="attribute-name-as-dtype"),
        pytest.param(_body(kind=0), id="kind-0"),
        pytest.param(_body(kind=3), id="kind-3"),
        pytest.param(_body(kind=int(ValueKind.BYTES)), id="bytes-with-dtype-and-shape"),
        pytest.param(_body(kind=int(ValueKind.BYTES), dtype=""), id="bytes-with-shape"),
        pytest.param(_body(kind=int(ValueKind.BYTES), shape=[]), id="bytes-with-dtype"),
    ],
)
def test_inconsistent_meta_is_corrupt(body: bytes) -> None:
    with pytest.raises(CorruptObjectError):
        decode_header(_frame(body))


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(_frame(_body(), magic=b"TKVX"), id="bad-magic"),
        pytest.param(_frame(_body(), magic=b"\x00" * 4), id="zero-magic"),
        pytest.param(_frame(_body(), version=0), id="version-0"),
        pytest.param(_frame(_body(), version=FORMAT_VERSION + 1), id="next-version"),
        pytest.param(PREFIX.pack(MAGIC, FORMAT_VERSION, 0, MAX_BODY + 1, 0), id="body-too-big"),
        pytest.param(
            PREFIX.pack(MAGIC, FORMAT_VERSION, 0, 10, checksum(_body())) + _body(),
            id="body-length-short",
        ),
        pytest.param(
            PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(_body()), checksum(_body()) ^ 1) + _body(),
            id="checksum-off-by-one-bit",
        ),
    ],
)
def test_bad_prefix_is_corrupt(raw: bytes) -> None:
    with pytest.raises(CorruptObjectError):
        decode_header(raw)


def test_header_length_checks_the_prefix_only() -> None:
    raw = encode_header(_valid())
    assert header_length(raw[: PREFIX.size]) == len(raw)
    with pytest.raises(CorruptObjectError):
        header_length(raw[: PREFIX.size - 1])
    with pytest.raises(CorruptObjectError):
        header_length(b"XXXX" + raw[4:])


def _bytes_header(key: bytes, parents: tuple[bytes, ...] = ()) -> ObjectHeader:
    return ObjectHeader(key, ObjectMeta(ValueKind.BYTES, "", (), 0, 0, parents), 0)


def _deep_header(dims: int) -> ObjectHeader:
    meta = ObjectMeta(ValueKind.TENSOR, "uint8", (1,) * dims, 1)
    return ObjectHeader(b"k", meta, 0)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(_bytes_header(b"k" * (MAX_KEY + 1)), id="key-too-long"),
        pytest.param(_bytes_header(b"k", (b"p" * (MAX_KEY + 1),)), id="parent-too-long"),
        pytest.param(_bytes_header(b"k", (b"p",) * (MAX_PARENTS + 1)), id="too-many-parents"),
        # each parent within the key limit, far fewer than MAX_PARENTS, the body over MAX_BODY
        pytest.param(_bytes_header(b"k", tuple(b"%d" % i + b"p" * 60_000 for i in range(20))),
                     id="body-too-large"),
        pytest.param(_deep_header(MAX_DIMS + 1), id="too-many-dims"),
    ],
)
def test_encode_refuses_what_decode_would_refuse(header: ObjectHeader) -> None:
    # Written but unreadable would lose the object silently; refuse it at write time instead.
    with pytest.raises(LimitExceededError):
        encode_header(header)
    with pytest.raises(LimitExceededError):
        check_header(header.key, header.meta)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(_bytes_header(b""), id="key-empty"),
        pytest.param(_bytes_header(b"k", (b"",)), id="parent-empty"),
    ],
)
def test_encode_refuses_empty_keys(header: ObjectHeader) -> None:
    with pytest.raises(ValueError):
        encode_header(header)


def test_decode_refuses_what_encode_refuses() -> None:
    # the bounds outside msgpack's own (key lengths) and the prefix's (body length), hand packed
    for header in (_bytes_header(b"k", (b"p",) * (MAX_PARENTS + 1)), _deep_header(MAX_DIMS + 1)):
        with pytest.raises(CorruptObjectError):
            decode_header(_frame(_pack(_fields(header))))
    header = _deep_header(MAX_DIMS)
    raw = encode_header(header)
    assert decode_header(raw) == (header, len(raw))


def _widest_body(header: ObjectHeader) -> int:
    """The body's length in the widest form a later write may give it: the largest generation
    and payload checksum."""
    meta = header.meta.with_generation(2**64 - 1)
    try:
        return encode_header_parts(header.key, meta).widest_size - PREFIX.size
    except LimitExceededError as exc:
        assert exc.limit == "header body bytes"
        return exc.actual


def _padded_header(body: int) -> ObjectHeader:
    """A header whose widest body is `body` bytes (parents of 60,000 bytes and one shorter)."""
    parents = (b"p" * 60_000,) * (MAX_BODY // 60_005)
    probe = 1000
    base = _widest_body(_bytes_header(b"k", (*parents, b"q" * probe)))
    header = _bytes_header(b"k", (*parents, b"q" * (probe + body - base)))
    assert _widest_body(header) == body
    return header


@pytest.mark.parametrize("slack", [-9, -1, 0, 1, 9])
def test_check_header_accepts_exactly_what_decodes_at_any_generation_and_checksum(
    slack: int,
) -> None:
    """At the body's bound: what `check_header` accepts is written and read back with the
    widest generation and checksum; one byte more is refused, by encode too."""
    header = _padded_header(MAX_BODY + slack)
    widest = ObjectHeader(header.key, header.meta.with_generation(2**64 - 1), 2**64 - 1)
    if slack > 0:
        with pytest.raises(LimitExceededError) as info:
            check_header(header.key, header.meta)
        assert info.value.limit == "header body bytes"
        with pytest.raises(LimitExceededError):
            encode_header(widest)
        return
    check_header(header.key, header.meta)
    raw = encode_header(widest)
    assert decode_header(raw) == (widest, len(raw))


@FAST
@given(st.binary(min_size=1, max_size=256), st.data())
def test_verify_payload_detects_length_and_byte_changes(
    payload: bytes, data: st.DataObject
) -> None:
    meta = ObjectMeta(ValueKind.BYTES, "", (), len(payload))
    header = ObjectHeader(b"\x02k", meta, checksum(payload))
    for good in (payload, bytearray(payload), memoryview(payload)):
        verify_payload(header, good)
    with pytest.raises(CorruptObjectError):
        verify_payload(header, payload + data.draw(st.binary(min_size=1, max_size=8)))
    with pytest.raises(CorruptObjectError):
        verify_payload(header, payload[: data.draw(st.integers(0, len(payload) - 1))])
    for position in range(len(payload)):
        changed = bytearray(payload)
        changed[position] ^= data.draw(st.integers(1, 255))
        with pytest.raises(CorruptObjectError):
            verify_payload(header, changed)


def test_verify_payload_of_an_empty_payload() -> None:
    header = ObjectHeader(b"\x02k", ObjectMeta(ValueKind.BYTES, "", (), 0), checksum(b""))
    verify_payload(header, b"")
    with pytest.raises(CorruptObjectError):
        verify_payload(header, b"\x00")


def test_checksum_is_xxh3_64() -> None:
    # Pinned: the value is part of the on-media format, a change of hash breaks every pool.
    assert checksum(b"") == 0x2D06800538D394C2
    assert checksum(bytearray(b"tierkv")) == checksum(memoryview(b"tierkv"))
