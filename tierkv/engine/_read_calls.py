"""The read half of the engine's public API: `get`, `get_many`, `prefetch`, `contains`,
`locate`.

A mixin of `Engine` (`engine.py` holds the lifecycle and the writes): each call encodes its keys,
asks `_reads` inside the engine's call context, decodes what it found onto the engine's device,
feeds the miss-storm watch and the latency histograms, and, with a tracer installed, records
its span. Apart from `engine.py` only to keep each file to one idea and a readable length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from time import perf_counter
from typing import TYPE_CHECKING

import torch

from tierkv.engine._call import Call
from tierkv.engine._reads import Found, Reads
from tierkv.engine._state import EngineState
from tierkv.engine._tracing import GET, GET_MANY, Tracing, traced_get
from tierkv.formats.value import decode_value
from tierkv.keys import Key, encode_key, key_list
from tierkv.tiers.base import Tier

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class ReadCalls:
    """`Engine`'s reads; the engine provides the attributes below."""

    _st: EngineState
    _reads: Reads
    tiers: tuple[Tier, ...]
    device: torch.device

    def _call(self) -> Call:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def _span(self, name: str, raw: bytes | None = None
              ) -> contextlib.AbstractContextManager[Span | None]:
        raise NotImplementedError

    async def get(self, key: Key) -> bytes | torch.Tensor | None:
        """The value stored under `key`, or ``None`` on a miss.

        Bytes-like values come back as `bytes`; tensors with their dtype and shape, on the engine's
        device (the gpu tier's device, else the CPU). A copy that fails its checksum or whose
        device fails is a miss, never wrong bytes.
        """
        started = perf_counter()
        raw = encode_key(key)
        st = self._st
        if st.tracing is not None:
            return await self._traced_get(st.tracing, key, raw, started)
        async with self._call():
            found = await self._reads.get(raw)
            served = self._reads.served
        if found is None:
            st.misses.missed(key, raw)
            value = None
        else:
            value = self._decode(found)
        st.latency.got(served, perf_counter() - started)
        return value

    async def _traced_get(self, tracing: Tracing, key: Key, raw: bytes, started: float
                          ) -> bytes | torch.Tensor | None:
        """`get` inside its span: a copy of its body, so that the untraced path (the hot one)
        pays for no span, no-op block or extra coroutine at all."""
        st = self._st
        with tracing.call(GET, raw) as span:
            async with self._call():
                found = await self._reads.get(raw)
                served = self._reads.served
            if found is None:
                st.misses.missed(key, raw)
                value = None
            else:
                value = self._decode(found)
            st.latency.got(served, perf_counter() - started)
            traced_get(span, None if served is None else st.names[served],
                       0 if found is None else found[0].nbytes)
            return value

    async def get_many(self, keys: Iterable[Key]) -> list[bytes | torch.Tensor | None]:
        """`get` of every key, results in order; lower-tier reads run concurrently, at most the
        lower tiers' queue depth at once. Under ``lru++`` the next `scheduler.prefetch_depth`
        known blocks of the chain after the leading run of hits are warmed in the background.
        `keys` may be any iterable (a generator too); a single key is a `TypeError`."""
        st = self._st
        started = perf_counter()
        keys = key_list(keys, "get_many's keys")  # iterated again below, with the results
        raws = [encode_key(key) for key in keys]
        with self._span(GET_MANY) as span:
            async with self._call():
                found = await self._reads.get_many(raws)
            values: list[bytes | torch.Tensor | None] = []
            for key, raw, got in zip(keys, raws, found, strict=True):
                if got is None:
                    st.misses.missed(key, raw)
                    values.append(None)
                else:
                    values.append(self._decode(got))
            st.latency.get_many.observe(perf_counter() - started)
            if span is not None:
                span.set_attributes({"tierkv.keys": len(keys),
                                     "tierkv.hits": sum(got is not None for got in found)})
        return values

    async def prefetch(self, keys: Iterable[Key]) -> int:
        """Warm `keys` into the first tier in the background, through the move executor and
        its byte budget; returns how many moves were started (keys absent, already on top or
        busy are skipped). Returns without waiting for the moves: `settle` waits for them.
        A single key is a `TypeError`."""
        raws = [encode_key(key) for key in key_list(keys, "prefetch's keys")]
        async with self._call():
            return self._reads.prefetch(raws)

    async def contains(self, key: Key) -> bool:
        self._check_open()
        return encode_key(key) in self._st.index

    async def locate(self, key: Key) -> str | None:
        """Name of the fastest tier holding `key`, or ``None``."""
        self._check_open()
        entry = self._st.index.get(encode_key(key))
        if entry is None or not entry.locations:
            return None
        return self.tiers[entry.locations[0]].name

    def _decode(self, found: Found) -> bytes | torch.Tensor:
        value = decode_value(*found)
        if isinstance(value, torch.Tensor) and value.device != self.device:
            value = value.to(self.device)
        return value
