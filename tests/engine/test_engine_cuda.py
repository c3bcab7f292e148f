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


# The tests below race the tier's copy stream against kernels the caller queued on its own
# stream. `torch.cuda._sleep` holds the caller's stream busy for ~0.1 s of GPU time first, so
# that a copy not ordered after those kernels runs before them every time.
SPIN = 200_000_000  # GPU clock cycles


def stall_current_stream() -> None:
    torch.cuda._sleep(SPIN)  # type: ignore[no-untyped-call]


async def test_a_got_tensor_is_not_reused_while_a_kernel_queued_on_it_waits() -> None:
    async with tierkv.open(cuda_config()) as kv:
        first = torch.full((1 << 16,), 1.0, device="cuda:0")
        await kv.put("first", first)
        await kv.put("second", torch.full((1 << 16,), 2.0, device="cuda:0"))
        got = await kv.get("first")
        assert isinstance(got, torch.Tensor)
        stall_current_stream()
        snapshot = got.clone()  # queued behind the stall
        del got  # its memory must stay reserved until the clone has read it
        second = await kv.get("second")
        assert isinstance(second, torch.Tensor)
        torch.cuda.synchronize()
        assert torch.equal(snapshot, first)


async def test_writes_through_a_pin_are_seen_by_the_next_get() -> None:
    async with tierkv.open(cuda_config()) as kv:
        await kv.put("p", torch.ones(1 << 16, device="cuda:0"))
        async with kv.pin("p") as handle:
            stall_current_stream()
            handle.value.fill_(3.0)  # queued behind the stall
        got = await kv.get("p")
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, torch.full((1 << 16,), 3.0, device="cuda:0"))


async def test_a_views_pending_reads_finish_before_its_slots_take_the_next_object() -> None:
    async with tierkv.open(cuda_config()) as kv:
        value = torch.ones(1 << 16, device="cuda:0")
        await kv.put("a", value)
        async with kv.pin("a") as handle:
            pass
        view = handle.value  # kept past the pin
        stall_current_stream()
        snapshot = view.clone()  # queued behind the stall
        del handle, view  # the slots are free once "a" is deleted
        await kv.delete("a")
        # from host memory: a put of a device tensor would wait for the caller's stream anyway
        await kv.put("b", torch.full((1 << 16,), 2.0))
        torch.cuda.synchronize()
        assert torch.equal(snapshot, value)


async def test_a_view_kept_past_close_still_reads_its_object() -> None:
    config = cuda_config()
    value = torch.arange(1 << 16, dtype=torch.float32, device="cuda:0")
    async with tierkv.open(config) as kv:
        await kv.put("a", value)
        async with kv.pin("a") as handle:
            view = handle.value
    del handle
    # the pool's size again: the allocator would hand over the pool's memory if it were free
    filler = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda:0")
    assert torch.equal(view, value)
    del filler
