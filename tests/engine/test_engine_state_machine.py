"""A hypothesis state machine of the engine against a dictionary model.

Invariant: a value read is always the last one put for that key, or a miss (after eviction) —
never another key's bytes, never a deleted or overwritten value. Tiers never exceed capacity.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import tierkv
from tests.engine.conftest import l1_config

KEYS = st.sampled_from([f"k{i}" for i in range(12)] + [b"k0", b"raw"])
VALUES = st.one_of(
    st.binary(min_size=0, max_size=900),
    st.lists(st.floats(allow_nan=False, width=32), min_size=0, max_size=150).map(
        lambda xs: torch.tensor(xs, dtype=torch.float32)
    ),
)


def same(a: bytes | torch.Tensor, b: bytes | torch.Tensor) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return isinstance(a, bytes) and isinstance(b, bytes) and a == b


class ModelMachine(RuleBasedStateMachine):
    """An engine beside a dictionary model; subclasses add the reads and their rules."""

    def make_config(self) -> dict[str, Any]:
        return l1_config(capacity="2KiB", slot_size="256B")

    def __init__(self) -> None:
        super().__init__()
        self.config = self.make_config()
        self.loop = asyncio.new_event_loop()
        self.kv = self.loop.run_until_complete(tierkv.open(self.config))
        self.model: dict[str | bytes, bytes | torch.Tensor] = {}

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @rule(key=KEYS, value=VALUES)
    def put(self, key: str | bytes, value: bytes | torch.Tensor) -> None:
        self.run(self.kv.put(key, value))
        self.model[key] = value.clone() if isinstance(value, torch.Tensor) else value

    @invariant()
    def within_capacity(self) -> None:
        for tier in self.kv.stats()["tiers"].values():
            assert tier["used"] <= tier["capacity"]

    def teardown(self) -> None:
        self.run(self.kv.close())
        self.loop.close()


class EngineMachine(ModelMachine):
    @rule(key=KEYS)
    def get(self, key: str | bytes) -> None:
        got = self.run(self.kv.get(key))
        if got is not None:
            assert key in self.model, "a deleted or never-put key was served"
            assert same(got, self.model[key])

    @rule(keys=st.lists(KEYS, max_size=5))
    def get_many(self, keys: list[str | bytes]) -> None:
        for key, got in zip(keys, self.run(self.kv.get_many(keys)), strict=True):
            if got is not None:
                assert same(got, self.model[key])

    @rule(key=KEYS)
    def delete(self, key: str | bytes) -> None:
        self.run(self.kv.delete(key))
        self.model.pop(key, None)
        assert self.run(self.kv.get(key)) is None

    @rule(key=KEYS)
    def pin_and_read(self, key: str | bytes) -> None:
        async def pin() -> None:
            try:
                async with self.kv.pin(key) as handle:
                    expected = self.model[key]
                    if isinstance(expected, torch.Tensor):
                        assert torch.equal(handle.value, expected)
                    else:
                        assert bytes(handle.value.numpy()) == expected
            except tierkv.ObjectNotFound:
                pass
            except tierkv.TierFullError:
                pass  # larger than the gpu tier

        self.run(pin())


TestEngineL1 = EngineMachine.TestCase
TestEngineL1.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
