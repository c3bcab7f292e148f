"""`PrefixCache`: a transformers model's KV cache stored block by block under chained keys."""

from __future__ import annotations

import asyncio
import logging
import struct

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from tierkv.engine import Engine
from tierkv.integrations.transformers._hf import (
    cache_layers,
    check_static_rope,
    decoder_config,
    layout_of,
    new_cache,
    rope_parameters,
)
from tierkv.integrations.transformers._hf import rope_theta as config_rope_theta
from tierkv.integrations.transformers._layout import BlockLayout
from tierkv.keys import BlockKey, block_keys

logger = logging.getLogger(__name__)


class PrefixCache:
    """Prefix KV reuse for one model (one set of weights) over a tierkv engine.

    ::

        cache = PrefixCache(kv, model, model_id="llama-tiny@rev1", block_tokens=16,
                            namespace=b"tenant-a")
        past, n = await cache.load(input_ids)
        out = model(input_ids[:, n:], **forward_kwargs(model, past))
        await cache.store(input_ids, output_cache(out))

    **Blocks.** Tokens ``[i * block_tokens, (i + 1) * block_tokens)`` of a prompt are block i,
    stored as ONE tensor of shape ``[layers, 2, kv_heads, block_tokens, head_dim]`` in the
    model's dtype (`BlockLayout`): axis 1 is keys (rotary embedding applied), then values, every
    layer of the model. With grouped-query attention `kv_heads` is the KV head count, smaller
    than the query heads. Only full blocks are stored; a partial tail is recomputed each time.

    **Keys.** Block i's key is ``block_keys(tokens, block_size=block_tokens, model=model_id,
    rope_theta=<the config's>, namespace=...)[i]``: a digest of the whole prefix up to the block's
    end, so a block is found only behind the same tokens. The namespace hashed is `namespace`
    (the tenant) framed together with the cache's layout and the config's rope parameters, so
    another model id or revision, rope base or scaling, dtype, shape or tenant never matches.
    `model_id` should name the weights ("name@revision"): `kv.invalidate_model(model_id)` removes
    every block stored under it.

    **Device and ownership.** `load` returns a fresh `DynamicCache` on the model's device, built
    from one `get_many`, that nothing else references: the model may extend it in place. `store`
    copies the blocks it writes out of `past` (a `DynamicCache` replaces its tensors as it grows,
    it never writes into them), so the caller may go on using `past` once `store` was called.

    **Concurrency.** Calls may run concurrently on the engine's loop; the stores of one
    `PrefixCache` run one at a time, so none writes a block another already wrote. Two
    `PrefixCache` objects storing the same new block at the same moment both write it: the second
    put replaces the first, and with it what was stored behind it (lost work, never a wrong
    value). Share one `PrefixCache` per model and tenant.

    Only batch-1 prompts (``input_ids`` of shape ``[1, T]``) and models whose layers are all full
    attention are supported (`ValueError` otherwise).
    """

    def __init__(self, kv: Engine, model: PreTrainedModel, *, model_id: str,
                 block_tokens: int = 16, namespace: bytes = b"",
                 rope_theta: float | None = None) -> None:
        """`kv`: an open engine. `model`: the transformers model whose cache is stored (its
        config and dtype are read now: cast it, make a new `PrefixCache`; its device at each
        `load`).
        `model_id`: the weights' name and revision. `block_tokens`: tokens per block (see
        docs/integrations.md). `namespace`: the tenant; blocks are never shared across two.
        `rope_theta` overrides the config's rotary base, for a config that names none.

        Raises `ValueError` for a `block_tokens` below 1 and for a model with layers other than
        full attention or no single rope base, `TypeError` for a `namespace` not bytes."""
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) \
                or block_tokens < 1:
            raise ValueError(f"block_tokens must be a positive int, not {block_tokens!r}")
        if not isinstance(namespace, bytes):
            raise TypeError("namespace must be bytes")
        if not isinstance(model_id, str) or not model_id:
            raise TypeError(f"model_id must be a non-empty str, not {model_id!r}")
        if not isinstance(getattr(model, "config", None), PretrainedConfig):
            raise TypeError("model must be a transformers model (with a config), not "
                            f"{type(model).__name__}")
        self.kv = kv
        self.model = model
        self.model_id = model_id
        self.namespace = namespace
        self._config = decoder_config(model)
        check_static_rope(self._config)
        self.layout: BlockLayout = layout_of(model, block_tokens)
        self.rope_theta = (config_rope_theta(self._config) if rope_theta is None
                           else float(rope_theta))
        fingerprint = self.layout.fingerprint(rope_parameters(self._config))
        self._salt = struct.pack("<I", len(namespace)) + namespace + fingerprint
        self._storing = asyncio.Lock()

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    def keys(self, input_ids: torch.Tensor) -> list[BlockKey]:
        """The key of every full block of `input_ids` (``[1, T]``)."""
        return self._keys(_tokens(input_ids))

    def _keys(self, tokens: list[int]) -> list[BlockKey]:
        return block_keys(tokens, block_size=self.layout.block_tokens, model=self.model_id,
                          rope_theta=self.rope_theta, namespace=self._salt)

    async def load(self, input_ids: torch.Tensor) -> tuple[DynamicCache | None, int]:
        """The KV of the longest cached run of leading blocks of `input_ids`: ``(past, n)``,
        where `past` holds the KV of ``input_ids[:, :n]``, or ``(None, 0)``.

        `n` is a multiple of `block_tokens` and at most ``T - 1``: the blocks looked up are those
        inside ``input_ids[:, :T-1]``, so that at least the last token is left to run and the
        model returns the logits of the next token. One `get_many` of those keys; the run ends
        at the first miss (or a stored value of another layout, logged). Raises what
        `get_many` raises (`EngineClosedError`, ...).
        """
        tokens = _tokens(input_ids)
        keys = self._keys(tokens[: len(tokens) - 1])
        if not keys:
            return None, 0
        found = await self.kv.get_many(keys)
        blocks: list[torch.Tensor] = []
        for index, value in enumerate(found):
            if value is None:
                break
            if not isinstance(value, torch.Tensor) or not self.layout.fits(value):
                logger.warning("block %d under %s is not a %s block: treated as a miss",
                               index, self.model_id, self.layout)
                break
            blocks.append(value)
        if not blocks:
            return None, 0
        layers = self.layout.unpack(blocks, self.model.device)
        return new_cache(self._config, layers), len(blocks) * self.layout.block_tokens

    async def store(self, input_ids: torch.Tensor, past_key_values: object) -> int:
        """Store every full block of `input_ids` that the engine does not hold yet, from
        `past_key_values` (the cache the model returned after running on `input_ids`, which
        may also hold later tokens); returns how many blocks were written.

        Each block is put with the block before it as its parent (the chain `put_many` links,
        and also the link from the first new block to the stored prefix it extends), so an
        `invalidate` of a block removes the blocks behind it. Raises `ValueError` when the cache
        does not match the model (layers, heads, dtype) or holds fewer tokens than the full
        blocks of `input_ids`, and what `put` raises (`TierFullError`, ...).
        """
        tokens = _tokens(input_ids)
        layers = cache_layers(past_key_values)
        keys = self._keys(tokens)
        self.layout.check(layers, len(keys) * self.layout.block_tokens)
        written = 0
        async with self._storing:
            parent: BlockKey | None = None
            for index, key in enumerate(keys):
                if not await self.kv.contains(key):
                    block = self.layout.pack(layers, index)
                    await self.kv.put(key, block, parents=() if parent is None else (parent,))
                    written += 1
                parent = key
        return written


def _tokens(input_ids: torch.Tensor) -> list[int]:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, not {type(input_ids).__name__}")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, T], not {list(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex \
            or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, not {input_ids.dtype}")
    tokens: list[int] = input_ids[0].tolist()
    return tokens
