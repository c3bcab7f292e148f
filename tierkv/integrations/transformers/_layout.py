"""One cached block as one tensor: every layer's keys and values for `block_tokens` tokens."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: per layer, the key and the value states, each ``[batch, kv_heads, tokens, head_dim]``
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape of a model's KV cache cut into blocks of `block_tokens` tokens.

    A block is one tensor of shape ``[layers, 2, kv_heads, block_tokens, head_dim]`` and dtype
    `dtype` (the model's): index 0 of the second axis holds the keys (after the rotary embedding,
    as the model caches them), index 1 the values, of tokens ``[i * block_tokens, (i + 1) *
    block_tokens)`` for block i. `kv_heads` is the model's key/value head count, which grouped-query
    attention makes smaller than its query heads: the cache holds each KV head once.
    """

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockLayout.{name} must be a positive int, not {value!r}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (keys and values)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    def fingerprint(self, rope: Mapping[str, object]) -> bytes:
        """Bytes naming what makes blocks of one model id interchangeable: the cache's shape and
        dtype and the rotary embedding's parameters (`rope`), which the keys carry rotated in."""
        described = {"layers": self.layers, "kv_heads": self.kv_heads,
                     "head_dim": self.head_dim, "dtype": str(self.dtype), "rope": rope}
        return json.dumps(described, sort_keys=True, default=repr).encode()

    def check(self, layers: Sequence[LayerKV], tokens: int) -> None:
        """`ValueError` unless `layers` is a batch-1 cache of this layout holding ≥ `tokens`."""
        if len(layers) != self.layers:
            raise ValueError(f"the cache has {len(layers)} layers, the model {self.layers}")
        for index, (keys, values) in enumerate(layers):
            for tensor in (keys, values):
                shape = tuple(tensor.shape)
                if (len(shape) != 4 or shape[0] != 1 or shape[1] != self.kv_heads
                        or shape[3] != self.head_dim or shape[2] < tokens):
                    raise ValueError(
                        f"layer {index} holds {tuple(tensor.shape)}; expected [1, "
                        f"{self.kv_heads}, >= {tokens}, {self.head_dim}]")
                if tensor.dtype != self.dtype:
                    raise ValueError(f"layer {index} holds {tensor.dtype}, the model {self.dtype}")

    def pack(self, layers: Sequence[LayerKV], block: int) -> torch.Tensor:
        """Block `block` of a `check`ed cache, as a new tensor on the cache's device."""
        start = block * self.block_tokens
        end = start + self.block_tokens
        out = torch.empty(self.shape, dtype=self.dtype, device=layers[0][0].device)
        for index, (keys, values) in enumerate(layers):
            out[index, 0].copy_(keys[0, :, start:end])
            out[index, 1].copy_(values[0, :, start:end])
        return out

    def fits(self, value: object) -> bool:
        """Whether a stored value is a block of this layout."""
        return (isinstance(value, torch.Tensor) and tuple(value.shape) == self.shape
                and value.dtype == self.dtype)

    def unpack(self, blocks: Sequence[torch.Tensor], device: torch.device) -> list[LayerKV]:
        """Consecutive blocks as per-layer ``[1, kv_heads, len(blocks) * block_tokens,
        head_dim]`` keys and values on `device`: views of one new tensor no one else holds."""
        joined = torch.cat([block.to(device) for block in blocks], dim=3)
        return [(joined[index, 0].unsqueeze(0), joined[index, 1].unsqueeze(0))
                for index in range(self.layers)]
