"""OpenTelemetry spans of the engine: the span tree of a get that misses the first tier, is
served by a lower one and promotes the object (the promotion a child of the get, in its trace,
though it runs after the get returned); spans of the other calls and their attributes; no key
bytes in any attribute; nothing traced without an SDK. The SDK's provider is passed to
`tierkv.open` (`tracer_provider=`): the global provider is never touched."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import tierkv
from tests.engine._configs import KiB, MiB, gpu_tier, nvme_tier, pmem_tier
from tests.engine.conftest import l1_config


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    yield spans
    spans.shutdown()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield tracer_provider
    tracer_provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def hierarchy(tmp_path: Path, lower: str) -> dict[str, Any]:
    below = pmem_tier(tmp_path) if lower == "pmem" else nvme_tier(tmp_path, capacity=16 * MiB)
    return {"scheduler": {"policy": "lru"},
            "tiers": [gpu_tier(capacity=64 * KiB, slot_size=4 * KiB), below]}


@pytest.mark.parametrize("lower", [pytest.param("pmem", marks=pytest.mark.pmem), "nvme"])
async def test_a_get_served_below_and_its_promotion_form_one_trace(
        tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter,
        lower: str) -> None:
    values = {f"k{i}": os.urandom(3000) for i in range(24)}
    async with tierkv.open(hierarchy(tmp_path, lower), tracer_provider=provider) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        await kv.settle()
        assert await kv.locate("k0") == lower  # the oldest went down first
        on_top = [key for key in values if await kv.locate(key) == "gpu"]
        for key in on_top[:6]:
            assert await kv.delete(key)  # room on top: the promotion needs no eviction
        await kv.settle()
        exporter.clear()

        assert await kv.get("k0") == values["k0"]
        await kv.settle()  # the promotion runs in the background, after the get returned
        assert await kv.locate("k0") == "gpu"

    [get] = named(exporter, "tierkv.get")
    assert get.attributes is not None
    assert get.attributes["tierkv.hit"] is True
    assert get.attributes["tierkv.tier"] == lower
    assert get.attributes["tierkv.bytes"] == 3000
    assert get.attributes["tierkv.key.kind"] == "str"
    assert get.status.status_code is not StatusCode.ERROR
    [promote] = named(exporter, "tierkv.promote")
    assert promote.parent is not None and get.context is not None
    assert promote.parent.span_id == get.context.span_id
    assert promote.context is not None and promote.context.trace_id == get.context.trace_id
    assert promote.attributes is not None
    assert promote.attributes["tierkv.source"] == lower
    assert promote.attributes["tierkv.target"] == "gpu"
    assert promote.attributes["tierkv.moved"] is True
    assert promote.attributes["tierkv.bytes"] == 3000
    assert promote.attributes["tierkv.key.hash"] == get.attributes["tierkv.key.hash"]
    assert promote.start_time is not None and get.end_time is not None


async def test_demotions_the_evictor_plans_start_traces_of_their_own(
        tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    async with tierkv.open(hierarchy(tmp_path, "nvme"), tracer_provider=provider) as kv:
        for i in range(24):
            await kv.put(f"k{i}", os.urandom(3000))
        await kv.settle()
    demotions = named(exporter, "tierkv.demote")
    assert demotions
    assert all(span.parent is None for span in demotions)
    assert all(span.attributes is not None and span.attributes["tierkv.target"] == "nvme"
               for span in demotions)


async def test_every_call_has_its_span_with_its_outcome(
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    async with tierkv.open(l1_config(), tracer_provider=provider) as kv:
        await kv.put_many({"a": b"1", "b": b"22"})
        assert await kv.get("missing") is None
        assert await kv.get_many(["a", "b", "missing"]) == [b"1", b"22", None]
        assert await kv.delete("a")
        assert await kv.invalidate("b") == 1
        assert await kv.invalidate_model("m@1") == 0
        await kv.flush()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert {"tierkv.put_many", "tierkv.put", "tierkv.get", "tierkv.get_many", "tierkv.delete",
            "tierkv.invalidate", "tierkv.invalidate_model", "tierkv.flush"} <= set(spans)
    put_many = spans["tierkv.put_many"]
    puts = named(exporter, "tierkv.put")
    assert len(puts) == 2
    assert put_many.context is not None
    assert all(p.parent is not None and p.parent.span_id == put_many.context.span_id
               for p in puts)
    second = puts[1].attributes or {}
    assert (second["tierkv.tier"], second["tierkv.bytes"]) == ("l1", 2)
    assert (spans["tierkv.get"].attributes or {})["tierkv.hit"] is False
    assert "tierkv.tier" not in (spans["tierkv.get"].attributes or {})
    many = spans["tierkv.get_many"].attributes or {}
    assert (many["tierkv.keys"], many["tierkv.hits"]) == (3, 2)
    assert (spans["tierkv.delete"].attributes or {})["tierkv.deleted"] is True
    assert (spans["tierkv.invalidate"].attributes or {})["tierkv.removed"] == 1


async def test_no_attribute_carries_key_bytes(
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    secret = "tenant-secret/prompt"
    async with tierkv.open(l1_config(), tracer_provider=provider) as kv:
        await kv.put(secret, b"v")
        assert await kv.get(secret) == b"v"
    for span in exporter.get_finished_spans():
        for value in (span.attributes or {}).values():
            assert "secret" not in str(value)


async def test_a_failed_call_is_an_error_span(
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    async with tierkv.open(l1_config(capacity="8KiB"), tracer_provider=provider) as kv:
        with pytest.raises(tierkv.TierFullError):
            await kv.put("big", os.urandom(64 * KiB))
    [put] = named(exporter, "tierkv.put")
    assert put.status.status_code is StatusCode.ERROR
    assert [event.name for event in put.events] == ["exception"]


async def test_a_cancelled_call_says_so_on_its_span(
        tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A call its caller cancelled ended its span with nothing to tell it from one that
    returned (OpenTelemetry records an `Exception` only)."""
    async with tierkv.open(hierarchy(tmp_path, "nvme"), tracer_provider=provider) as kv:
        for i in range(8):
            await kv.put(f"k{i}", os.urandom(4 * KiB))
        flush = asyncio.create_task(kv.flush())
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # into the log's writes
        assert not flush.done()
        flush.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flush
    cancelled = [span for span in named(exporter, "tierkv.flush")
                 if span.attributes and span.attributes.get("tierkv.cancelled")]
    assert len(cancelled) == 1
    assert cancelled[0].status.status_code is StatusCode.UNSET


async def test_without_an_sdk_calls_run_in_no_span() -> None:
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("an SDK provider was installed globally in this test session")
    async with tierkv.open(l1_config()) as kv:
        await kv.put("k", b"v")
        assert await kv.get("k") == b"v"
        assert trace.get_current_span() is trace.INVALID_SPAN
    no_op = trace.NoOpTracerProvider()
    async with tierkv.open(l1_config(), tracer_provider=no_op) as kv:
        await kv.put("k", b"v")
