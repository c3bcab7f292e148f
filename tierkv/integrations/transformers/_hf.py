"""What differs between transformers versions, in one place.

- The cache argument of ``forward`` and the output field: ``past_key_values`` up to 4.x,
  ``cache`` from 5.0 (the old name is accepted there with a deprecation message).
- The rotary base: ``config.rope_theta`` in 4.x, ``config.rope_parameters["rope_theta"]`` in 5.x.
- A `DynamicCache`'s tensors: ``cache.layers[i].keys`` from 4.56, ``cache.key_cache[i]`` before,
  or the legacy tuple of ``(keys, values)`` per layer.

Only full-attention decoder layers are supported: a sliding-window layer keeps the last window of
tokens, not the prefix, so its cache cannot be cut into prefix blocks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from tierkv.integrations.transformers._layout import BlockLayout, LayerKV


def decoder_config(model: PreTrainedModel) -> PretrainedConfig:
    config: PretrainedConfig = model.config
    getter = getattr(config, "get_text_config", None)
    return config if getter is None else getter(decoder=True)


def rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """Everything that decides the rotary embedding (base, scaling type and factors)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        return dict(params)
    found: dict[str, Any] = {}
    if (theta := getattr(config, "rope_theta", None)) is not None:
        found["rope_theta"] = theta
    if isinstance(scaling := getattr(config, "rope_scaling", None), dict):
        found.update(scaling)
    return found


#: rope types whose rotation of a position depends on the length of the whole sequence: the
#: keys of a prefix cached from one prompt differ from those a longer prompt computes
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def check_static_rope(config: PretrainedConfig) -> None:
    """`ValueError` for a rotary embedding whose rotation depends on the sequence's length
    (dynamic NTK scaling, LongRoPE): a cached prefix would not be what a full recompute
    computes (logits off by 2e-3 with dynamic scaling of 4)."""
    params = rope_parameters(config)
    layers = [p for p in params.values() if isinstance(p, dict)] or [params]
    for layer in layers:
        kind = layer.get("rope_type", layer.get("type"))
        if kind in _LENGTH_DEPENDENT_ROPE:
            raise ValueError(f"the model's rotary embedding ({kind!r} scaling) depends on the "
                             "sequence's length: a cached prefix's keys would differ from a "
                             "recompute's")


def rope_theta(config: PretrainedConfig) -> float:
    """The model's rotary base; `ValueError` for a model with none or with several."""
    params = rope_parameters(config)
    if "rope_theta" in params:
        return float(params["rope_theta"])
    # 5.x models with one rope per layer type: {"full_attention": {...}, ...}
    thetas = {float(p["rope_theta"]) for p in params.values()
              if isinstance(p, dict) and "rope_theta" in p}
    if len(thetas) != 1:
        raise ValueError("the model's config names no single rope_theta: pass rope_theta=")
    return thetas.pop()


def layout_of(model: PreTrainedModel, block_tokens: int) -> BlockLayout:
    """The block layout of `model`'s KV cache; `ValueError` for layers that are not full
    attention (sliding windows, linear attention)."""
    config = decoder_config(model)
    types = getattr(config, "layer_types", None) or ()
    if others := sorted({t for t in types if t != "full_attention"}):
        raise ValueError(f"only full-attention layers can be cached as prefix blocks, the model "
                         f"has {', '.join(others)} layers")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return BlockLayout(int(config.num_hidden_layers), kv_heads, head_dim, block_tokens,
                       model.dtype)


def cache_layers(past: object) -> list[LayerKV]:
    """Per layer, the key and value tensors a model's cache holds (not copied).

    Layers of 4.56 on must be plain `DynamicLayer`s: the sliding-window, quantized and indexed
    kinds keep something other than every token's KV in `keys`, and a `StaticLayer`'s tensors
    run past the tokens it holds (and are written in place)."""
    layers = getattr(past, "layers", None)
    if layers is not None:
        from transformers.cache_utils import DynamicLayer

        found = []
        for index, layer in enumerate(layers):
            if type(layer) is not DynamicLayer:
                raise ValueError(f"cache layer {index} is a {type(layer).__name__}: only a "
                                 "full-attention DynamicLayer holds a prefix's KV")
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
                raise ValueError(f"cache layer {index} holds no key and value tensors")
            found.append((keys, values))
        return found
    key_cache, value_cache = getattr(past, "key_cache", None), getattr(past, "value_cache", None)
    if isinstance(key_cache, list) and isinstance(value_cache, list):
        return list(zip(key_cache, value_cache, strict=True))
    if isinstance(past, tuple | list) and all(
            isinstance(item, tuple | list) and len(item) >= 2 for item in past):
        return [(item[0], item[1]) for item in past]
    raise TypeError(f"not a transformers KV cache: {type(past).__name__}")


def new_cache(config: PretrainedConfig, layers: Sequence[LayerKV]) -> DynamicCache:
    """A `DynamicCache` holding `layers` (their tensors are copied in)."""
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # before 4.56 a DynamicCache takes no config
        cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


@functools.cache
def _cache_argument(forward: object) -> str:
    parameters = inspect.signature(forward).parameters  # type: ignore[arg-type]
    return "cache" if "cache" in parameters else "past_key_values"


def forward_kwargs(model: PreTrainedModel, past: object) -> dict[str, Any]:
    """The keyword arguments that run `model` on top of `past` (a cache `PrefixCache.load`
    returned, or ``None``) and return the extended cache: ``cache=`` or ``past_key_values=``,
    whichever this transformers version names it, and ``use_cache=True``."""
    return {_cache_argument(type(model).forward): past, "use_cache": True}


def output_cache(outputs: object) -> object:
    """The cache a forward returned (``outputs.cache`` or ``outputs.past_key_values``)."""
    for name in ("cache", "past_key_values"):
        if (found := getattr(outputs, name, None)) is not None:
            return found
    raise ValueError("the model returned no cache: run it with use_cache=True")
