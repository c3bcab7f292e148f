"""The engine with its L1 on a CUDA device (skipped with a reason where there is none)."""

from __future__ import annotations

import pytest
import torch

import tierkv

pytestmark = pytest.mark.gpu


def cuda_config() -> dict[str, object]:
    return {"tiers": [{"name": "gpu", "kind": "gpu", "device": "cuda:0", "capacity": "64MiB",
                       "slot_size": "1MiB", "ttl": "60s"}]}


async def test_device_tensors_round_trip_on_the_device() -> None:
    async with tierkv.open(cuda_config()) as kv:
        tensor = torch.randn(256, 128, device="cuda:0", dtype=torch.float16)
        await kv.put("t", tensor)
        got = await kv.get("t")
        assert isinstance(got, torch.Tensor)
        assert got.device.type == "cuda" and torch.equal(got, tensor)
        host = torch.arange(1000, dtype=torch.int32)
        await kv.put("host", host)
        from_host = await kv.get("host")
        assert isinstance(from_host, torch.Tensor) and torch.equal(from_host.cpu(), host)
        await kv.put("b", b"bytes on the gpu")
        assert await kv.get("b") == b"bytes on the gpu"


async def test_pin_is_a_view_of_device_memory() -> None:
    async with tierkv.open(cuda_config()) as kv:
        tensor = torch.ones(1024, device="cuda:0")
        await kv.put("p", tensor)
        async with kv.pin("p") as handle:
            assert handle.value.device.type == "cuda"
            handle.value.mul_(3)
        got = await kv.get("p")
        assert isinstance(got, torch.Tensor) and float(got.sum()) == 3 * 1024


async def test_tensor_produced_on_another_stream_is_copied_after_it() -> None:
    async with tierkv.open(cuda_config()) as kv:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            big = torch.randn(1 << 20, device="cuda:0")
            value = big * 2
            await kv.put("s", value)
        got = await kv.get("s")
        assert isinstance(got, torch.Tensor) and torch.equal(got, value)
