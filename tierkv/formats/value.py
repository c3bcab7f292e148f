"""Value codec: bytes-like objects and torch tensors to a flat payload and back, without pickle.

A value becomes (`ObjectMeta`, payload). A bytes-like value is any C-contiguous buffer (bytes,
bytearray, memoryview, a numpy array, an `array.array`, ...); its payload is a flat `memoryview`
of its raw bytes (no copy); the payload of a tensor is its storage viewed as a flat ``uint8``
tensor on the tensor's own device (one copy only when the tensor is not contiguous).
`decode_value` rebuilds the value from a payload and its meta: `bytes` for bytes-like values, a
tensor of the recorded dtype and shape for tensors. Only dtypes named in `DTYPES` exist on
media; anything else is refused.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from typing_extensions import Buffer

from tierkv._untracked import untrack
from tierkv.errors import CorruptObjectError, LimitExceededError

#: what `encode_value` stores: any C-contiguous buffer (stored as its raw bytes) or a tensor
Value = Buffer | torch.Tensor
Payload = memoryview | bytes | bytearray | torch.Tensor


class ValueKind(enum.IntEnum):
    BYTES = 1
    TENSOR = 2


DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_DIMS = 32


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What a tier stores beside the payload bytes, and what the header records on media.

    `generation` orders writes of the same key (the newest wins at recovery); `parents` are the
    canonical keys this object was derived from (the write-invalidation DAG's edges).
    """

    kind: ValueKind
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    generation: int = 0
    parents: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        untrack(self)  # atoms only: no cycle can pass through it (`tierkv._untracked`)

    def with_generation(self, generation: int) -> ObjectMeta:
        return ObjectMeta(self.kind, self.dtype, self.shape, self.nbytes, generation, self.parents)


def shape_limit(shape: tuple[int, ...]) -> LimitExceededError | None:
    """The bound of the format that `shape` exceeds, as the error that says so, or None.

    The one statement of the bound: encoders raise the error (a value that could be written but
    never read back is refused), decoders turn it into `CorruptObjectError`."""
    if len(shape) > MAX_DIMS:
        return LimitExceededError("tensor dimensions", MAX_DIMS, len(shape))
    return None


def validate_meta(kind: ValueKind, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    """Raise `CorruptObjectError` unless kind, dtype, shape and length describe one value."""
    if nbytes < 0:
        raise CorruptObjectError("negative payload length")
    if kind is ValueKind.BYTES:
        if dtype or shape:
            raise CorruptObjectError("a bytes value has no dtype or shape")
        return
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise CorruptObjectError(f"unknown dtype {dtype!r}")
    exceeded = shape_limit(shape)
    if exceeded is not None:
        raise CorruptObjectError(str(exceeded))
    if any(d < 0 for d in shape):
        raise CorruptObjectError(f"bad shape {shape!r}")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    if math.prod(shape) * itemsize != nbytes:
        raise CorruptObjectError(f"shape {shape} of {dtype} does not take {nbytes} bytes")


def encode_value(value: Value, *, parents: tuple[bytes, ...] = ()) -> tuple[ObjectMeta, Payload]:
    """Split a value into its meta and a flat payload (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        name = _checked_tensor(value)
        resolved = value.detach().resolve_conj().resolve_neg()
        flat = resolved.contiguous().reshape(-1)
        if flat.numel() == 1 and flat.stride(0) != 1:
            # torch counts a one-element tensor as contiguous whatever its strides (x[:, 3] of
            # a 1x8 x keeps stride 8), and a byte view needs a last stride of 1
            flat = flat.as_strided((1,), (1,))
        flat = flat.view(torch.uint8)
        meta = ObjectMeta(ValueKind.TENSOR, name, tuple(value.shape), flat.numel(), 0, parents)
        return meta, flat
    view = _byte_view(value)
    return ObjectMeta(ValueKind.BYTES, "", (), view.nbytes, 0, parents), view


def value_meta(value: Value, *, parents: tuple[bytes, ...] = ()) -> ObjectMeta:
    """The meta `encode_value` would return for `value`, and the `TypeError` or `ValueError` it
    would raise, without encoding it (no copy of a tensor that is not contiguous)."""
    if isinstance(value, torch.Tensor):
        name = _checked_tensor(value)
        return ObjectMeta(ValueKind.TENSOR, name, tuple(value.shape),
                          value.numel() * value.element_size(), 0, parents)
    return ObjectMeta(ValueKind.BYTES, "", (), _byte_view(value).nbytes, 0, parents)


def _checked_tensor(value: torch.Tensor) -> str:
    """The name of the tensor's dtype; `TypeError`/`ValueError` for a tensor not stored."""
    name = _DTYPE_NAMES.get(value.dtype)
    if name is None:
        raise TypeError(f"tensors of dtype {value.dtype} cannot be stored")
    if value.is_sparse or value.layout is not torch.strided or value.is_nested:
        raise TypeError("only dense strided tensors can be stored")
    if value.is_meta:
        # shape and dtype without storage: there are no bytes to copy, and the tiers' copies
        # would fail deep inside with torch's NotImplementedError
        raise TypeError("a tensor on the meta device has no data to store")
    exceeded = shape_limit(tuple(value.shape))
    if exceeded is not None:
        raise exceeded
    return name


def _byte_view(value: Buffer) -> memoryview:
    """A flat ``B`` view of any C-contiguous buffer (bytes, bytearray, memoryview, a numpy
    array, an `array.array`, a ctypes array, ...): its raw bytes, in memory order, not copied
    (the tiers copy them before a put returns). `TypeError` for what is no buffer and for a
    buffer that is not C-contiguous (a Fortran-ordered or strided one): its bytes in memory
    are not the value's in order."""
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(f"a value is bytes-like (a buffer) or a torch.Tensor, not "
                        f"{type(value).__name__}") from None
    if not view.c_contiguous:
        raise TypeError("a bytes-like value must be C-contiguous (bytes(value) or "
                        "numpy.ascontiguousarray(value) makes a copy that is)")
    if view.format == "B" and view.ndim == 1:
        return view
    if view.nbytes == 0:
        return memoryview(b"")  # memoryview refuses to cast a shape with a zero in it
    return view.cast("B")


def payload_view(payload: Payload) -> memoryview:
    """A flat byte view of a host payload (a CPU tensor is viewed, not copied)."""
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu":
            payload = payload.cpu()
        return memoryview(payload.numpy()).cast("B")  # type: ignore[arg-type]
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def decode_value(meta: ObjectMeta, payload: Payload) -> bytes | torch.Tensor:
    """Rebuild the value; the caller hands over ownership of `payload` (it may be aliased)."""
    length = payload.numel() if isinstance(payload, torch.Tensor) else payload_view(payload).nbytes
    if length != meta.nbytes:
        raise CorruptObjectError(f"payload holds {length} bytes, meta says {meta.nbytes}")
    if meta.kind is ValueKind.BYTES:
        if isinstance(payload, bytes):
            return payload
        return bytes(payload_view(payload))
    dtype = DTYPES[meta.dtype]
    if isinstance(payload, torch.Tensor):
        flat = payload
    elif meta.nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        buffer = payload if isinstance(payload, bytearray | memoryview) else bytearray(payload)
        if isinstance(buffer, memoryview) and buffer.readonly:
            buffer = bytearray(buffer)
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).reshape(meta.shape)
