"""The value codec (`tierkv.formats.value`): bytes-like values and tensors, never pickle."""

from __future__ import annotations

import array
import ctypes
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typing_extensions import Buffer

from tierkv import CorruptObjectError, LimitExceededError
from tierkv.formats.value import (
    DTYPES,
    MAX_DIMS,
    ObjectMeta,
    Payload,
    ValueKind,
    decode_value,
    encode_value,
    payload_view,
    validate_meta,
)

FAST = settings(max_examples=40, deadline=None)
shapes = st.lists(st.integers(min_value=0, max_value=5), max_size=4).map(tuple)


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor whose bytes are all distinct-ish, so a mixed-up byte order shows."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (max(1, _numel(shape)) * 16,), dtype=torch.uint8, generator=generator
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    flat = raw[: _numel(shape) * itemsize]
    if dtype is torch.bool:
        return (flat % 2).to(torch.bool).reshape(shape)
    return flat.view(dtype).reshape(shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _same(left: torch.Tensor, right: torch.Tensor) -> bool:
    """Bitwise equality: NaNs in random float bytes must compare equal to themselves."""
    if left.dtype != right.dtype or left.shape != right.shape:
        return False
    as_bytes = [t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
                for t in (left, right)]
    return bool(torch.equal(as_bytes[0], as_bytes[1]))


def _through_bytes(meta: ObjectMeta, payload: Payload) -> bytes | torch.Tensor:
    """Decode from a copy of the payload bytes, as a tier that stored them would."""
    return decode_value(meta, bytes(payload_view(payload)))


@pytest.mark.parametrize("value", [b"", b"hello", bytearray(b"\x00\xff" * 100)])
def test_bytes_like_round_trip(value: bytes | bytearray) -> None:
    meta, payload = encode_value(value)
    assert meta == ObjectMeta(ValueKind.BYTES, "", (), len(value))
    for decoded in (decode_value(meta, payload), _through_bytes(meta, payload)):
        assert type(decoded) is bytes
        assert decoded == bytes(value)


def test_bytes_payload_is_a_view_not_a_copy() -> None:
    value = bytearray(b"abcd")
    _, payload = encode_value(value)
    value[0] = ord("z")
    assert bytes(payload_view(payload)) == b"zbcd"


def test_memoryview_of_other_formats_is_flattened_to_bytes() -> None:
    numbers = array.array("i", [1, 2, 3])
    meta, payload = encode_value(memoryview(numbers))
    assert meta.nbytes == numbers.itemsize * 3
    assert decode_value(meta, payload) == numbers.tobytes()
    matrix = memoryview(bytes(range(6))).cast("B", (2, 3))
    meta, payload = encode_value(matrix)
    assert _through_bytes(meta, payload) == bytes(range(6))


def _ctypes_ints() -> ctypes.Array[ctypes.c_int]:
    return (ctypes.c_int * 4)(1, 2, 3, 4)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(np.arange(1000, dtype=np.uint8), id="numpy-uint8"),
        pytest.param(np.arange(20, dtype=np.float64).reshape(4, 5), id="numpy-2d"),
        pytest.param(np.arange(4, dtype=">f8"), id="numpy-big-endian"),
        pytest.param(np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]), id="numpy-structured"),
        pytest.param(np.array(3.0), id="numpy-0-dim"),
        pytest.param(np.empty((0, 5)), id="numpy-empty"),
        pytest.param(array.array("i", [1, 2, 3]), id="array.array"),
        pytest.param(_ctypes_ints(), id="ctypes"),
        pytest.param(np.arange(20.0).reshape(4, 5).data, id="memoryview-2d"),
    ],
)
def test_any_c_contiguous_buffer_is_stored_as_its_raw_bytes(value: Buffer) -> None:
    raw = memoryview(value).tobytes()
    meta, payload = encode_value(value)
    assert meta == ObjectMeta(ValueKind.BYTES, "", (), len(raw))
    for decoded in (decode_value(meta, payload), _through_bytes(meta, payload)):
        assert type(decoded) is bytes and decoded == raw


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(np.asfortranarray(np.arange(20.0).reshape(4, 5)), id="numpy-fortran"),
        pytest.param(np.asfortranarray(np.arange(20.0).reshape(4, 5)).data,
                     id="memoryview-fortran"),
        pytest.param(np.arange(10)[::2], id="numpy-strided"),
        pytest.param(memoryview(b"abcdef")[::2], id="memoryview-strided"),
    ],
)
def test_a_buffer_that_is_not_c_contiguous_is_refused(value: Buffer) -> None:
    # Fortran order is contiguous, but its bytes in memory are not the value's in order
    with pytest.raises(TypeError):
        encode_value(value)


@FAST
@given(st.binary(max_size=512), st.sampled_from([bytes, bytearray, memoryview]))
def test_bytes_like_round_trip_hypothesis(data: bytes, wrap: type) -> None:
    meta, payload = encode_value(wrap(data))
    assert meta.kind is ValueKind.BYTES and meta.nbytes == len(data)
    assert _through_bytes(meta, payload) == data


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 4)])
def test_tensor_round_trip_every_dtype(name: str, shape: tuple[int, ...]) -> None:
    tensor = _sample(DTYPES[name], shape)
    meta, payload = encode_value(tensor, parents=(b"\x02p",))
    assert meta.kind is ValueKind.TENSOR
    assert (meta.dtype, meta.shape, meta.parents) == (name, shape, (b"\x02p",))
    assert meta.nbytes == tensor.numel() * tensor.element_size()
    for decoded in (decode_value(meta, payload), _through_bytes(meta, payload)):
        assert isinstance(decoded, torch.Tensor)
        assert _same(decoded, tensor)


@FAST
@given(st.sampled_from(sorted(DTYPES)), shapes, st.integers(min_value=0, max_value=2**16))
def test_tensor_round_trip_hypothesis(name: str, shape: tuple[int, ...], seed: int) -> None:
    tensor = _sample(DTYPES[name], shape, seed)
    meta, payload = encode_value(tensor)
    decoded = _through_bytes(meta, payload)
    assert isinstance(decoded, torch.Tensor)
    assert _same(decoded, tensor)


@FAST
@given(st.sampled_from(sorted(DTYPES)), st.integers(min_value=0, max_value=2**16))
def test_non_contiguous_tensors_round_trip(name: str, seed: int) -> None:
    base = _sample(DTYPES[name], (4, 6), seed)
    views = [
        base.t(),
        base[:, ::2],
        base[1:3, 1:],
        base[:1].expand(3, 6),
        base.unsqueeze(0)[..., 5],
        base[:1, 3],  # one element that keeps its row's stride (6), which torch calls contiguous
        base[:1, :1].unsqueeze(0)[:, :, 0],
    ]
    for view in views:
        meta, payload = encode_value(view)
        decoded = _through_bytes(meta, payload)
        assert isinstance(decoded, torch.Tensor)
        assert _same(decoded, view)
        assert decoded.is_contiguous()


def test_tensor_with_storage_offset_and_grad_round_trips() -> None:
    base = torch.arange(10, dtype=torch.float64, requires_grad=True)
    view = base[3:7]
    meta, payload = encode_value(view)
    decoded = _through_bytes(meta, payload)
    assert isinstance(decoded, torch.Tensor)
    assert torch.equal(decoded, view.detach())
    assert not decoded.requires_grad


def test_decode_from_readonly_and_writable_buffers() -> None:
    tensor = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    meta, payload = encode_value(tensor)
    data = bytes(payload_view(payload))
    for buffer in (data, bytearray(data), memoryview(data), memoryview(bytearray(data))):
        decoded = decode_value(meta, buffer)
        assert isinstance(decoded, torch.Tensor)
        assert torch.equal(decoded, tensor)


def test_decoded_tensor_does_not_alias_readonly_input() -> None:
    tensor = torch.arange(4, dtype=torch.int16)
    meta, payload = encode_value(tensor)
    data = bytes(payload_view(payload))
    decoded = decode_value(meta, data)
    assert isinstance(decoded, torch.Tensor)
    decoded.zero_()  # must not write through to an immutable bytes object
    assert data == bytes(payload_view(encode_value(tensor)[1]))


def test_conjugate_view_round_trips() -> None:
    tensor = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    meta, payload = encode_value(tensor)
    decoded = _through_bytes(meta, payload)
    assert isinstance(decoded, torch.Tensor)
    assert torch.equal(decoded, tensor)


@pytest.mark.parametrize(
    "dtype",
    [torch.uint16, torch.uint32, torch.uint64, torch.complex32, torch.float8_e4m3fnuz, torch.qint8],
)
def test_unsupported_dtypes_are_refused(dtype: torch.dtype) -> None:
    with warnings.catch_warnings():
        # torch warns that complex32 is experimental and quantized creation is deprecated.
        warnings.simplefilter("ignore", UserWarning)
        if dtype is torch.qint8:
            tensor = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, dtype)
        else:
            tensor = torch.zeros(2, dtype=dtype)
    with pytest.raises(TypeError):
        encode_value(tensor)


def test_tensors_of_more_dims_than_the_format_holds_are_refused() -> None:
    deepest = torch.arange(6, dtype=torch.int8).reshape([1] * (MAX_DIMS - 2) + [2, 3])
    got = _through_bytes(*encode_value(deepest))
    assert isinstance(got, torch.Tensor) and torch.equal(got, deepest)
    with pytest.raises(LimitExceededError) as info:
        encode_value(deepest.unsqueeze(0))
    assert info.value.maximum == MAX_DIMS
    # and decoding refuses the same meta: the bound is one function (`shape_limit`)
    meta = ObjectMeta(ValueKind.TENSOR, "int8", (1,) * (MAX_DIMS + 1), 1)
    with pytest.raises(CorruptObjectError):
        validate_meta(meta.kind, meta.dtype, meta.shape, meta.nbytes)


def test_sparse_tensors_are_refused() -> None:
    with pytest.raises(TypeError):
        encode_value(torch.eye(3).to_sparse())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_refused() -> None:
    # a nested tensor's layout reads as strided; its shape raised torch's RuntimeError
    with pytest.raises(TypeError, match="dense strided"):
        encode_value(torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]))


def test_tensors_without_data_are_refused() -> None:
    with pytest.raises(TypeError):
        encode_value(torch.empty(3, device="meta"))


@pytest.mark.parametrize("value", [None, 1, 1.5, "text", [1, 2], (b"a",), {"a": b"b"}])
def test_non_tensor_values_are_refused(value: object) -> None:
    with pytest.raises(TypeError):
        encode_value(value)  # type: ignore[arg-type]


def test_non_contiguous_memoryview_is_refused() -> None:
    with pytest.raises(TypeError):
        encode_value(memoryview(b"abcdef")[::2])


PAYLOAD_FORMS = ["bytes", "bytearray", "memoryview", "tensor"]


def _payload(form: str, data: bytes) -> Payload:
    """`data` in one of the forms a tier may hand to `decode_value`."""
    if form == "tensor":
        return torch.tensor(list(data), dtype=torch.uint8)
    if form == "bytearray":
        return bytearray(data)
    return memoryview(data) if form == "memoryview" else data


@FAST
@given(
    st.one_of(
        st.binary(max_size=64),
        st.sampled_from(sorted(DTYPES)).flatmap(
            lambda name: shapes.map(lambda shape: _sample(DTYPES[name], shape))
        ),
    ),
    st.integers(min_value=0, max_value=128),
    st.sampled_from(PAYLOAD_FORMS),
)
def test_payload_of_wrong_length_is_corrupt(
    value: bytes | torch.Tensor, length: int, form: str
) -> None:
    meta, _ = encode_value(value)
    if length == meta.nbytes:
        length += 1
    with pytest.raises(CorruptObjectError):
        decode_value(meta, _payload(form, bytes(length)))


@pytest.mark.parametrize("form", PAYLOAD_FORMS)
@pytest.mark.parametrize(
    ("value", "length"),
    [
        pytest.param(torch.zeros(12, dtype=torch.float32), 0, id="empty-for-48"),
        pytest.param(torch.zeros(12, dtype=torch.float32), 47, id="one-short"),
        pytest.param(torch.zeros(0, dtype=torch.float32), 3, id="3-for-empty-tensor"),
        pytest.param(b"abc", 4, id="bytes-one-long"),
        pytest.param(b"abc", 0, id="bytes-empty"),
        pytest.param(b"", 1, id="1-for-empty-bytes"),
    ],
)
def test_payload_of_wrong_length_edge_cases(
    value: bytes | torch.Tensor, length: int, form: str
) -> None:
    meta, _ = encode_value(value)
    with pytest.raises(CorruptObjectError):
        decode_value(meta, _payload(form, bytes(length)))


def test_payload_view_is_flat_bytes() -> None:
    tensor = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    _, payload = encode_value(tensor)
    view = payload_view(payload)
    assert view.format == "B" and view.ndim == 1 and view.nbytes == 12
    assert bytes(view) == tensor.numpy().tobytes()
    assert payload_view(b"ab").tobytes() == b"ab"
    assert payload_view(memoryview(array.array("h", [1]))).format == "B"


def test_meta_with_generation_keeps_the_rest() -> None:
    meta = ObjectMeta(ValueKind.TENSOR, "int8", (2,), 2, 0, (b"\x02a",))
    newer = meta.with_generation(7)
    assert newer == ObjectMeta(ValueKind.TENSOR, "int8", (2,), 2, 7, (b"\x02a",))
