"""Prefix KV reuse in a transformers model: time to first token with tierkv and without.

A random-init Llama (`SHAPES`, no download; on the CPU hidden 1024, 8 layers, 16 heads over 8 KV
heads, float32), on CUDA where there is one, serves conversation-shaped requests twice each, one
after the other: recomputing the whole prompt (the baseline), and through `PrefixCache` (load the
longest cached prefix, run the rest, store the new blocks after the first token). The model runs
on a worker thread, as a server runs it, so the engine's background moves go on meanwhile. Two
workloads, replayed in this order:

- ``conversation``: `Workload.sessions` conversations taken in turn, round robin; a first prompt
  of `first` tokens, and each later turn appends `step` tokens (the reply and the next question)
  to the whole history before it.
- ``qa``: one system prompt of `first` tokens shared by every session; each session's turns
  append `step` tokens of its own questions and answers behind it.

Time to first token (TTFT) = the time until the logits of the prompt's last token are known: the
forward of the whole prompt, or the `load` plus the forward of the rest. The prefill a load
replaces = the baseline's TTFT minus the forward of the rest, per request with a cached prefix.
The engine is the configured hierarchy resized (`capacity_point`, 20 / 30 / 50 %) to 1.25 times
the workloads' distinct blocks, so nothing is dropped and the blocks spread over every tier; the
tier serving each block is the difference of the engine's hit counters around each load.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tierkv.bench.common import Progress, Row, no_progress, percentile
from tierkv.bench.trace_config import ReplayPolicy, capacity_point
from tierkv.config import Config
from tierkv.engine import Engine
from tierkv.engine import open as open_engine
from tierkv.errors import ConfigError
from tierkv.keys import block_keys

try:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

    from tierkv.integrations.transformers import PrefixCache, forward_kwargs, output_cache
    from tierkv.integrations.transformers._hf import layout_of
except ImportError as exc:  # the CLI imports this module only for --device transformers
    raise ConfigError("--device transformers needs the transformers extra "
                      "(pip install 'tierkv[transformers]')") from exc


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int = 4096


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: int
    turns: int
    first: int
    step: int
    shared_first: bool


#: the model and the requests: the full run on the CPU, a larger model on CUDA, and a tiny one
#: for `--quick` (float32 all: the dtype CPUs compute fastest)
SHAPES = {"cpu": Shape(1024, 8, 16, 8, 2816), "cuda": Shape(2048, 16, 16, 8, 5632),
          "quick": Shape(128, 2, 4, 2, 256, vocab=512)}
WORKLOADS = {
    "full": (Workload("conversation", sessions=4, turns=5, first=512, step=256,
                      shared_first=False),
             Workload("qa", sessions=4, turns=4, first=1024, step=128, shared_first=True)),
    "quick": (Workload("conversation", 2, 3, 48, 32, False), Workload("qa", 2, 2, 48, 16, True)),
}
BLOCK_TOKENS = 16


def prompts(workload: Workload, vocab: int, seed: int) -> list[list[int]]:
    """The requests' token ids, in replay order (round robin over the sessions)."""
    generator = torch.Generator().manual_seed(seed)

    def fresh(count: int) -> list[int]:
        ids: list[int] = torch.randint(0, vocab, (count,), generator=generator).tolist()
        return ids

    shared = fresh(workload.first)
    history = [list(shared) if workload.shared_first else fresh(workload.first)
               for _ in range(workload.sessions)]
    requests = []
    for turn in range(workload.turns):
        for session in history:
            if turn or workload.shared_first:
                session.extend(fresh(workload.step))
            requests.append(list(session))
    return requests


def _model(shape: Shape, device: torch.device) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.mlp, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=8192)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.to(device)  # type: ignore[arg-type]  # transformers wraps Module.to: mypy misbinds it
    model.train(False)
    return model


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


async def run_transformers_bench(config: Config, *, quick: bool = False,
                                 progress: Progress = no_progress
                                 ) -> tuple[dict[str, Any], list[Row]]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES["quick" if quick else device.type]
    model = _model(shape, device)
    layout = layout_of(model, BLOCK_TOKENS)
    workloads = WORKLOADS["quick" if quick else "full"]
    requests = {w.name: prompts(w, shape.vocab, seed) for seed, w in enumerate(workloads)}
    distinct = {key for batch in requests.values() for ids in batch
                for key in block_keys(ids, block_size=BLOCK_TOKENS, model="m", rope_theta=0.0)}
    total = int(1.25 * len(distinct) * layout.block_bytes)
    result: dict[str, Any] = {"model": {**asdict(shape), "dtype": str(layout.dtype),
                                        "device": str(device), "block_tokens": BLOCK_TOKENS,
                                        "kv_bytes_per_token": layout.bytes_per_token,
                                        "block_bytes": layout.block_bytes},
                              "distinct_blocks": len(distinct)}
    warm = torch.zeros((1, 64), dtype=torch.long, device=device)
    await asyncio.to_thread(_forward, model, warm, None, {})  # the kernels' first-call costs
    with capacity_point(config, total, layout.block_bytes, ReplayPolicy.TIERKV) as (sized, tiers):
        result["tiers"] = [asdict(tier) for tier in tiers]
        async with open_engine(sized) as kv:
            cache = PrefixCache(kv, model, model_id="bench-llama@random-init",
                                block_tokens=BLOCK_TOKENS)
            for workload in workloads:
                result[workload.name] = await _replay(kv, cache, requests[workload.name],
                                                      workload.name, progress)
    return result, _rows(result, workloads)


def _last_logits_only(model: PreTrainedModel) -> dict[str, int]:
    """Only the last position's logits, in both runs (the name of 4.50 on, else nothing)."""
    named = "logits_to_keep" in inspect.signature(type(model).forward).parameters
    return {"logits_to_keep": 1} if named else {}


def _forward(model: PreTrainedModel, input_ids: torch.Tensor, past: object,
             extra: dict[str, int]) -> Any:
    """The model on `input_ids` over `past`, on a worker thread, as a server runs it: the loop
    (and the engine's background moves) go on meanwhile."""
    with torch.no_grad():  # per thread
        return model(input_ids, **forward_kwargs(model, past), **extra)


async def _replay(kv: Engine, cache: PrefixCache, requests: list[list[int]], name: str,
                  progress: Progress) -> dict[str, Any]:
    model, device = cache.model, cache.model.device
    last = _last_logits_only(model)
    samples = []
    for done, ids in enumerate(requests):
        input_ids = torch.tensor([ids], device=device)
        started = _clock(device)
        full = (await asyncio.to_thread(_forward, model, input_ids, None, last)).logits
        recompute = _clock(device) - started
        hits = Counter(kv.stats()["engine"]["hits"])
        started = _clock(device)
        past, n = await cache.load(input_ids)
        loaded = _clock(device)
        out = await asyncio.to_thread(_forward, model, input_ids[:, n:], past, last)
        first_token = int(out.logits[0, -1].argmax())
        ready = _clock(device)
        served = Counter(kv.stats()["engine"]["hits"])
        served.subtract(hits)
        await cache.store(input_ids, output_cache(out))
        samples.append({"tokens": len(ids), "cached": n, "recompute_s": recompute,
                        "load_s": loaded - started, "rest_s": ready - loaded,
                        "ttft_s": ready - started, "store_s": _clock(device) - ready,
                        "same_first_token": first_token == int(full[0, -1].argmax()),
                        "max_logit_diff": float((out.logits - full).abs().max()),
                        "blocks_by_tier": {t: c for t, c in served.items() if c}})
        progress(f"transformers: {name}", done + 1, len(requests))
    return _summary(samples)


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    def ms(field: str, fraction: float) -> float:
        return percentile(sorted(s[field] for s in samples), fraction) * 1000

    reused = [s for s in samples if s["cached"]]
    replaced = sum(s["recompute_s"] - s["rest_s"] for s in reused)
    tiers: Counter[str] = Counter()
    for sample in samples:
        tiers.update(sample["blocks_by_tier"])
    return {
        "requests": samples, "blocks_by_tier": dict(tiers),
        "tokens": sum(s["tokens"] for s in samples),
        "cached_tokens": sum(s["cached"] for s in samples),
        **{f"{field}_{label}_ms": ms(field, fraction)
           for field in ("recompute_s", "ttft_s", "rest_s", "load_s", "store_s")
           for label, fraction in (("p50", 0.5), ("p99", 0.99))},
        "ttft_mean_ratio": (sum(s["ttft_s"] for s in samples)
                            / sum(s["recompute_s"] for s in samples)),
        "load_over_replaced": sum(s["load_s"] for s in reused) / replaced if replaced > 0
        else None,
        "max_logit_diff": max(s["max_logit_diff"] for s in samples),
        "same_first_token": all(s["same_first_token"] for s in samples),
    }


def _rows(result: dict[str, Any], workloads: tuple[Workload, ...]) -> list[Row]:
    model = result["model"]
    rows = [Row(f"KV bytes per token: Llama {model['layers']} layers, hidden {model['hidden']}, "
                f"{model['heads']} heads / {model['kv_heads']} KV heads, {model['dtype']}",
                "bytes", model["kv_bytes_per_token"])]
    for workload in workloads:
        w, s = workload.name, result[workload.name]
        goal = workload.name == "conversation"  # the goals are set on this workload
        rows += [
            Row(f"{w}: TTFT p50 with tierkv", "ms", s["ttft_s_p50_ms"],
                s["recompute_s_p50_ms"], "recompute"),
            Row(f"{w}: TTFT p99 with tierkv", "ms", s["ttft_s_p99_ms"],
                s["recompute_s_p99_ms"], "recompute"),
            Row(f"{w}: TTFT with / without tierkv (sum over requests)", "ratio",
                s["ttft_mean_ratio"], at_most=0.5 if goal else None),
            Row(f"{w}: prefill per request p50 (the uncached rest)", "ms", s["rest_s_p50_ms"],
                s["recompute_s_p50_ms"], "whole prompt"),
            Row(f"{w}: prefill per request p99 (the uncached rest)", "ms", s["rest_s_p99_ms"],
                s["recompute_s_p99_ms"], "whole prompt"),
            Row(f"{w}: load p50 (get_many + DynamicCache)", "ms", s["load_s_p50_ms"]),
            Row(f"{w}: store p50 (after the first token)", "ms", s["store_s_p50_ms"]),
            Row(f"{w}: tokens served from cache", "tokens", s["cached_tokens"], s["tokens"],
                "prompt tokens"),
            Row(f"{w}: max |logit difference| vs recompute", "abs", s["max_logit_diff"],
                at_most=1e-5 if model["dtype"] == "torch.float32" else None),
        ]
        if s["load_over_replaced"] is not None:
            rows.append(Row(f"{w}: load / the prefill it replaces", "ratio",
                            s["load_over_replaced"], at_most=0.1 if goal else None))
        rows += [Row(f"{w}: blocks served by {tier}", "blocks", count)
                 for tier, count in s["blocks_by_tier"].items()]
    return rows
