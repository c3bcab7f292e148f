"""`PrefixCache` over a real gpu(CPU) → pmem → nvme engine with random-init Llama models.

Two shapes: 4 layers, 4 heads over 2 KV heads, hidden 256 (head_dim 64), float32; and 3 layers,
6 heads over 2 KV heads, hidden 192 (head_dim 32), bfloat16. A prompt's logits computed on top of
a loaded prefix are compared with a full recompute of the whole prompt: within 1e-5 in float32,
and within `BF16_ULPS` units in the last place of the largest logit in bfloat16. Measured on the
CPU at these prompt lengths: both bit-identical, over 20 seeds and 3 prefix lengths. Longer
prompts (256-1280 cached tokens) differ by up to 7e-7 in float32 (the attention kernel sums in
another order when the query is shorter than the keys) and by 0 in bfloat16; the bf16 bound
leaves room for kernels (CUDA's) that round a bf16 logit once or twice differently.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config

pytest.importorskip("transformers", reason="the transformers extra is not installed")
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    StaticCache,
)
from transformers.cache_utils import DynamicLayer

from tierkv.integrations.transformers import (
    PrefixCache,
    forward_kwargs,
    output_cache,
)

pytestmark = pytest.mark.pmem

BLOCK = 16
VOCAB = 512
FP32_TOLERANCE = 1e-5
#: bf16 logits may differ from the full recompute by this many ulps of the largest logit
BF16_ULPS = 4


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    dtype: torch.dtype


SHAPES = {
    "fp32-h4-kv2-d64": Shape(layers=4, heads=4, kv_heads=2, hidden=256, dtype=torch.float32),
    "bf16-h6-kv2-d32": Shape(layers=3, heads=6, kv_heads=2, hidden=192, dtype=torch.bfloat16),
}
FP32 = "fp32-h4-kv2-d64"


def new_model(shape_name: str, rope_theta: float = 10_000.0, seed: int = 0,
              dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    """A random-init Llama (no download), in eval mode; the same seed gives the same weights."""
    shape = SHAPES[shape_name]
    # `rope_theta` is a keyword of 4.x and 5.x alike (5.x files it under rope_parameters)
    rope: dict[str, Any] = {"rope_theta": rope_theta}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=shape.hidden,
                         intermediate_size=2 * shape.hidden, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=1024, **rope)
    torch.manual_seed(seed)
    model = moved(LlamaForCausalLM(config), dtype or shape.dtype)
    model.train(False)  # eval mode (transformers leaves `eval` untyped)
    return model


def moved(model: LlamaForCausalLM, to: torch.dtype | str) -> LlamaForCausalLM:
    """`model.to(to)`, which moves the module itself (transformers wraps `Module.to` with
    `functools.wraps`, which mypy binds to the wrong self)."""
    model.to(to)  # type: ignore[arg-type]
    return model


#: models shared by the tests (never moved or cast: `new_model` makes one to change)
build_model = functools.cache(new_model)


def engine_config(directory: Path) -> dict[str, Any]:
    # 16 slots of 64 KiB (one fp32 block each) on the CPU; what L1 lets go lands in pmem, nvme
    return hierarchy_config(directory, ("gpu", "pmem", "nvme"),
                            gpu={"capacity": MiB, "slot_size": 64 * KiB})


@pytest.fixture
async def kv(tmp_path: Path) -> AsyncIterator[tierkv.Engine]:
    async with tierkv.open(engine_config(tmp_path)) as engine:
        yield engine


@pytest.fixture(params=list(SHAPES))
def shape(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def tokens(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, count), generator=generator)


def run(model: PreTrainedModel, input_ids: torch.Tensor, past: object = None) -> Any:
    with torch.no_grad():
        return model(input_ids, **forward_kwargs(model, past))


def full_logits(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids, use_cache=False).logits
    return logits


def tolerance(reference: torch.Tensor) -> float:
    if reference.dtype == torch.float32:
        return FP32_TOLERANCE
    assert reference.dtype == torch.bfloat16
    largest = reference.float().abs().max().item()
    return BF16_ULPS * 2.0 ** (math.floor(math.log2(largest)) - 7)  # bf16: 8 significand bits


def seq_length(past: object) -> int:
    assert isinstance(past, DynamicCache)
    return past.get_seq_length()


async def prefill_and_store(cache: PrefixCache, input_ids: torch.Tensor) -> int:
    out = run(cache.model, input_ids)
    return await cache.store(input_ids, output_cache(out))


async def resume(cache: PrefixCache, input_ids: torch.Tensor) -> tuple[int, torch.Tensor, Any]:
    """Load the cached prefix of `input_ids`, run the rest: (n, its logits, the output)."""
    past, n = await cache.load(input_ids)
    out = run(cache.model, input_ids[:, n:], past)
    logits: torch.Tensor = out.logits
    return n, logits, out


def assert_matches_recompute(model: PreTrainedModel, input_ids: torch.Tensor, n: int,
                             logits: torch.Tensor) -> None:
    reference = full_logits(model, input_ids)[:, n:]
    assert logits.shape == reference.shape
    difference = (logits.float() - reference.float()).abs().max().item()
    assert difference <= tolerance(reference), difference
    assert torch.equal(logits[0, -1].argmax(), reference[0, -1].argmax())


@pytest.mark.parametrize("shared_blocks", [1, 3])
async def test_shared_prefix_matches_full_recompute(kv: tierkv.Engine, shape: str,
                                                    shared_blocks: int) -> None:
    model = build_model(shape)
    cache = PrefixCache(kv, model, model_id=f"llama-{shape}@rev1", block_tokens=BLOCK,
                        namespace=b"tenant-a")
    first = tokens(4 * BLOCK + 5, seed=1)
    assert await prefill_and_store(cache, first) == 4
    second = torch.cat([first[:, : shared_blocks * BLOCK], tokens(20, seed=2)], dim=1)
    n, logits, out = await resume(cache, second)
    assert n == shared_blocks * BLOCK
    assert_matches_recompute(model, second, n, logits)
    assert seq_length(output_cache(out)) == second.shape[1]


async def test_whole_prompt_cached_leaves_its_last_block_to_run(kv: tierkv.Engine) -> None:
    model = build_model(FP32)
    cache = PrefixCache(kv, model, model_id="llama@rev1", block_tokens=BLOCK)
    prompt = tokens(4 * BLOCK, seed=3)
    await prefill_and_store(cache, prompt)
    # only input_ids[:, :T-1] is looked up: the block holding the last token is recomputed
    n, logits, _ = await resume(cache, prompt)
    assert n == 3 * BLOCK
    assert_matches_recompute(model, prompt, n, logits)
    longer = torch.cat([prompt, tokens(1, seed=4)], dim=1)
    n, logits, _ = await resume(cache, longer)
    assert n == 4 * BLOCK
    assert_matches_recompute(model, longer, n, logits)


async def test_conversation_stores_only_new_blocks_linked_to_its_prefix(
        kv: tierkv.Engine) -> None:
    model = build_model(FP32)
    cache = PrefixCache(kv, model, model_id="llama@rev1", block_tokens=BLOCK)
    turn1 = tokens(2 * BLOCK + 7, seed=5)
    assert await prefill_and_store(cache, turn1) == 2
    assert await prefill_and_store(cache, turn1) == 0  # stored already: nothing written
    turn2 = torch.cat([turn1, tokens(3 * BLOCK, seed=6)], dim=1)
    n, logits, out = await resume(cache, turn2)
    assert n == 2 * BLOCK
    assert_matches_recompute(model, turn2, n, logits)
    assert await cache.store(turn2, output_cache(out)) == 3
    keys = cache.keys(turn2)
    assert len(keys) == 5 and all([await kv.contains(key) for key in keys])
    # the first block turn 2 wrote hangs under turn 1's last: invalidating block 1 takes 1..4
    assert await kv.invalidate(keys[1]) == 4
    assert (await cache.load(turn2))[1] == BLOCK


async def test_a_prompt_differing_in_its_first_token_loads_nothing(kv: tierkv.Engine) -> None:
    cache = PrefixCache(kv, build_model(FP32), model_id="llama@rev1", block_tokens=BLOCK)
    prompt = tokens(3 * BLOCK + 1, seed=7)
    await prefill_and_store(cache, prompt)
    other = prompt.clone()
    other[0, 0] = (int(other[0, 0]) + 1) % VOCAB
    assert await cache.load(other) == (None, 0)
    assert (await cache.load(prompt))[1] == 3 * BLOCK


async def test_invalidate_model_removes_only_that_model(kv: tierkv.Engine) -> None:
    model = build_model(FP32)
    rev1 = PrefixCache(kv, model, model_id="llama@rev1", block_tokens=BLOCK)
    rev2 = PrefixCache(kv, model, model_id="llama@rev2", block_tokens=BLOCK)
    prompt = tokens(3 * BLOCK + 1, seed=8)
    assert await prefill_and_store(rev1, prompt) == 3
    assert await prefill_and_store(rev2, prompt) == 3  # another revision: its own blocks
    assert await kv.invalidate_model("llama@rev1") == 3
    assert await rev1.load(prompt) == (None, 0)
    n, logits, _ = await resume(rev2, prompt)
    assert n == 3 * BLOCK
    assert_matches_recompute(model, prompt, n, logits)


async def test_a_tenant_never_loads_another_tenants_blocks(kv: tierkv.Engine) -> None:
    model = build_model(FP32)
    tenant_a = PrefixCache(kv, model, model_id="llama@rev1", namespace=b"tenant-a")
    tenant_b = PrefixCache(kv, model, model_id="llama@rev1", namespace=b"tenant-b")
    prompt = tokens(2 * BLOCK + 3, seed=9)
    await prefill_and_store(tenant_a, prompt)
    assert await tenant_b.load(prompt) == (None, 0)
    assert await prefill_and_store(tenant_b, prompt) == 2  # written again, under b's keys
    assert not set(tenant_a.keys(prompt)) & set(tenant_b.keys(prompt))
    assert (await tenant_a.load(prompt))[1] == 2 * BLOCK


async def test_another_rope_base_or_dtype_never_matches(kv: tierkv.Engine) -> None:
    model = build_model(FP32)
    stored = PrefixCache(kv, model, model_id="llama@rev1")
    prompt = tokens(2 * BLOCK + 3, seed=10)
    await prefill_and_store(stored, prompt)
    # the same weights under another rotary base compute other keys: the config's theta is
    # part of the block keys
    rebased = build_model(FP32, rope_theta=500_000.0)
    assert torch.equal(rebased.lm_head.weight, model.lm_head.weight)
    assert await PrefixCache(kv, rebased, model_id="llama@rev1").load(prompt) == (None, 0)
    overridden = PrefixCache(kv, model, model_id="llama@rev1", rope_theta=20_000.0)
    assert await overridden.load(prompt) == (None, 0)
    halved = new_model(FP32, dtype=torch.bfloat16)
    assert await PrefixCache(kv, halved, model_id="llama@rev1").load(prompt) == (None, 0)
    assert (await stored.load(prompt))[1] == 2 * BLOCK


async def test_each_load_returns_a_fresh_cache(kv: tierkv.Engine) -> None:
    model = build_model(FP32)
    cache = PrefixCache(kv, model, model_id="llama@rev1")
    prompt = tokens(2 * BLOCK + 9, seed=11)
    await prefill_and_store(cache, prompt)
    n, first_logits, out = await resume(cache, prompt)  # the model extends the loaded cache
    assert seq_length(output_cache(out)) == prompt.shape[1]
    past, again = await cache.load(prompt)
    assert again == n == 2 * BLOCK
    assert past is not None and past.get_seq_length() == n
    assert torch.equal(run(model, prompt[:, n:], past).logits, first_logits)


async def test_a_restarted_engine_serves_the_blocks_from_its_persistent_tiers(
        tmp_path: Path) -> None:
    model = build_model(FP32)
    prompt = tokens(5 * BLOCK + 2, seed=12)
    async with tierkv.open(engine_config(tmp_path)) as kv:
        await prefill_and_store(PrefixCache(kv, model, model_id="llama@rev1"), prompt)
    async with tierkv.open(engine_config(tmp_path)) as kv:  # the gpu tier starts empty
        n, logits, _ = await resume(PrefixCache(kv, model, model_id="llama@rev1"), prompt)
        hits = kv.stats()["engine"]["hits"]
    assert n == 5 * BLOCK
    assert_matches_recompute(model, prompt, n, logits)
    assert sum(hits.values()) == 5 and "gpu" not in hits


async def test_bad_prompts_and_foreign_caches_are_refused(kv: tierkv.Engine) -> None:
    model = build_model(FP32)
    cache = PrefixCache(kv, model, model_id="llama@rev1")
    with pytest.raises(ValueError):
        await cache.load(tokens(40, seed=13).repeat(2, 1))  # a batch of 2
    with pytest.raises(TypeError):
        await cache.load(tokens(40, seed=13).float())
    with pytest.raises(ValueError):
        PrefixCache(kv, model, model_id="llama@rev1", block_tokens=0)
    with pytest.raises(TypeError, match="model_id"):  # accepted, then failed at `load`
        PrefixCache(kv, model, model_id=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="transformers model"):  # a bare AttributeError
        PrefixCache(kv, object(), model_id="llama@rev1")  # type: ignore[arg-type]
    other = build_model("bf16-h6-kv2-d32")
    prompt = tokens(2 * BLOCK, seed=14)
    with pytest.raises(ValueError):  # a cache of another model's shape
        await cache.store(prompt, output_cache(run(other, prompt)))
    short = output_cache(run(model, prompt[:, :BLOCK]))
    with pytest.raises(ValueError):  # holds fewer tokens than the prompt's full blocks
        await cache.store(prompt, short)
    static = StaticCache(config=model.config, max_cache_len=4 * BLOCK)
    run(model, prompt, static)
    with pytest.raises(ValueError):  # its tensors run past the tokens it holds
        await cache.store(prompt, static)
    assert not any([await kv.contains(key) for key in cache.keys(prompt)])


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
async def test_a_rotary_embedding_that_depends_on_the_length_is_refused(
        kv: tierkv.Engine, kind: str) -> None:
    """Dynamic NTK scaling rotates a position by the whole sequence's length: a prefix cached
    from one prompt is not what a longer prompt computes (logits off by 2e-3, factor 4), and
    the cache was accepted."""
    model = build_model(FP32)
    scaled = copy.deepcopy(model.config)
    # 5.x files the scaling under rope_parameters (rope_scaling is a deprecated alias of it)
    scaled.rope_parameters = {"rope_type": kind, "factor": 4.0, "rope_theta": 10_000.0}
    with pytest.raises(ValueError, match="depends on the sequence's length"):
        PrefixCache(kv, _with_config(model, scaled), model_id="llama@rev1")


def _with_config(model: LlamaForCausalLM, config: Any) -> LlamaForCausalLM:
    """A shallow copy of `model` whose config is `config` (no new weights)."""
    clone = copy.copy(model)
    clone.config = config
    return clone


@pytest.mark.gpu
async def test_on_cuda_the_cache_is_loaded_onto_the_models_device(tmp_path: Path) -> None:
    model = moved(new_model(FP32), "cuda")
    # the gpu tier alone, which holds the three blocks: the pmem tier needs PMDK, which a
    # machine with a GPU need not have, and is not what this test is about
    config = hierarchy_config(tmp_path, ("gpu",), gpu={"device": "cuda:0", "capacity": MiB,
                                                      "slot_size": 64 * KiB})
    prompt = tokens(3 * BLOCK + 4, seed=15).to("cuda")
    async with tierkv.open(config) as kv:
        cache = PrefixCache(kv, model, model_id="llama@rev1")
        await prefill_and_store(cache, prompt)
        past, n = await cache.load(prompt)
        assert n == 3 * BLOCK and past is not None
        assert all(isinstance(layer, DynamicLayer) and layer.keys is not None
                   and layer.keys.device == model.device for layer in past.layers)
        logits = run(model, prompt[:, n:], past).logits
        reference = full_logits(model, prompt)[:, n:]
        # CUDA kernels tile a short remainder differently from the whole prompt
        assert (logits - reference).abs().max().item() <= 1e-4
