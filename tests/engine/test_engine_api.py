"""The public engine API on an L1-only engine (CPU device)."""

from __future__ import annotations

import array
import asyncio
import math
import os
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
import torch
from typing_extensions import Buffer

import tierkv
from tests.engine.conftest import l1_config


async def test_open_as_await_and_as_context_manager(tmp_path: Path) -> None:
    kv = await tierkv.open(l1_config())
    await kv.put("k", b"v")
    assert await kv.get("k") == b"v"
    await kv.close()
    await kv.close()  # idempotent
    with pytest.raises(tierkv.EngineClosedError):
        await kv.get("k")
    config_file = tmp_path / "devices.toml"
    config_file.write_text(
        '[[tiers]]\nname = "l1"\nkind = "gpu"\ndevice = "cpu"\ncapacity = "64KiB"\n'
        'slot_size = "4KiB"\n'
    )
    async with tierkv.open(config_file) as kv2:
        assert await kv2.get("k") is None


async def test_values_round_trip_with_kind_dtype_and_shape() -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put(b"raw", bytearray(b"abc"))
        await kv.put("mv", memoryview(b"defg"))
        tensor = torch.randn(4, 5, dtype=torch.float32)
        await kv.put("t", tensor)
        half = torch.ones(3, 2, dtype=torch.bfloat16)
        await kv.put("h", half)
        assert await kv.get(b"raw") == b"abc"
        assert await kv.get("mv") == b"defg"
        got = await kv.get("t")
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert torch.equal(got, tensor)
        got_half = await kv.get("h")
        assert isinstance(got_half, torch.Tensor) and got_half.shape == (3, 2)
        assert torch.equal(got_half, half)
        tensor.fill_(0)  # the engine kept its own copy
        still = await kv.get("t")
        assert isinstance(still, torch.Tensor) and not torch.equal(still, tensor)


def numpy_buffer(data: npt.NDArray[Any]) -> Buffer:
    """`data` as the buffer it is at run time (numpy's stubs declare its `__buffer__` for
    Python 3.12 on only)."""
    return cast(Buffer, data)


async def test_any_c_contiguous_buffer_is_a_bytes_value_snapshotted_at_put() -> None:
    async with tierkv.open(l1_config(capacity="4MiB", slot_size="64KiB")) as kv:
        # 512 KiB and more are copied by the native worker threads (host_copies = "auto")
        for size in (10, 100_000, 700_000):
            values: dict[str, Buffer] = {
                "numpy": numpy_buffer(np.frombuffer(os.urandom(size), dtype=np.uint8).copy()),
                "array": array.array("B", os.urandom(size)),
                "bytearray": bytearray(os.urandom(size)),
            }
            for name, value in values.items():
                before = bytes(value)
                await kv.put(f"{name}{size}", value)
                memoryview(value).cast("B")[:] = bytes(size)  # the source changes after put
                assert await kv.get(f"{name}{size}") == before
        matrix = np.arange(12, dtype=np.float32).reshape(3, 4)
        await kv.put("matrix", numpy_buffer(matrix))
        assert await kv.get("matrix") == matrix.tobytes()
        with pytest.raises(TypeError):
            await kv.put("fortran", numpy_buffer(np.asfortranarray(matrix)))
        assert not await kv.contains("fortran")


async def test_bytes_and_str_keys_are_distinct() -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put(b"a", b"bytes")
        await kv.put("a", b"str")
        assert await kv.get(b"a") == b"bytes"
        assert await kv.get("a") == b"str"


async def test_block_keys_store_and_find_prefix() -> None:
    tokens = list(range(64))
    keys = tierkv.block_keys(tokens, block_size=16, model="m@1", rope_theta=1e4)
    async with tierkv.open(l1_config()) as kv:
        for i, key in enumerate(keys[:2]):
            await kv.put(key, bytes([i]) * 10)
        again = tierkv.block_keys(tokens[:48], block_size=16, model="m@1", rope_theta=1e4)
        assert await kv.get_many(again) == [bytes([0]) * 10, bytes([1]) * 10, None]


async def test_contains_locate_delete_invalidate() -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put("k", b"v")
        assert await kv.contains("k")
        assert await kv.locate("k") == "l1"
        assert await kv.invalidate("k") == 1
        assert await kv.invalidate("k") == 0
        assert not await kv.contains("k")
        assert await kv.locate("k") is None
        await kv.put("k", b"v")
        assert await kv.delete("k")
        assert not await kv.delete("k")
        assert await kv.get("k") is None


async def test_put_many_and_get_many_keep_order() -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put_many({f"k{i}": bytes([i]) for i in range(5)})
        await kv.put_many([("x", b"1"), ("y", b"2")])
        got = await kv.get_many(["k4", "nope", "k0", "y"])
        assert got == [bytes([4]), None, bytes([0]), b"2"]


@pytest.mark.parametrize("items", [
    [("a", b"1"), ("b", None)], [("a", b"1"), (3, b"x")], [("a", b"1"), ("e",)],
    [("a", b"1"), "e"], {"a": b"1", "b": 5}, None, "ab", b"ab",
], ids=repr)
async def test_put_many_checks_every_item_before_it_stores_any(items: Any) -> None:
    # the first items were stored, and the bad one raised when its turn came
    async with tierkv.open(l1_config()) as kv:
        with pytest.raises(TypeError, match=r"put_many|key|value"):
            await kv.put_many(items)
        assert not await kv.contains("a")


@pytest.mark.parametrize("model", ["m" * 70_000, "llama\udcff@rev1"], ids=["long", "surrogate"])
async def test_put_many_checks_a_blocks_model_before_it_stores_any(model: str) -> None:
    """A hand-built `BlockKey` whose model no version key can be made of (longer than a key,
    no UTF-8 form): raised before the items before it were stored (it passed the up-front
    check and failed at its own put)."""
    bad = tierkv.BlockKey(os.urandom(16), 16, 1.0, model=model)
    async with tierkv.open(l1_config()) as kv:
        with pytest.raises(ValueError, match=r"model|parent|key"):
            items: list[tuple[tierkv.Key, bytes]] = [("a", b"1"), (bad, b"2")]
            await kv.put_many(items)
        assert not await kv.contains("a")


async def test_calls_that_take_many_keys_take_any_iterable_once() -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put_many((f"k{i}", bytes([i])) for i in range(3))
        await kv.put("child", b"c", parents=(f"k{i}" for i in range(2)))
        keys = ["k2", "nope", "k0"]
        assert await kv.get_many(key for key in keys) == [bytes([2]), None, bytes([0])]
        assert await kv.get_many(iter(keys)) == [bytes([2]), None, bytes([0])]
        await kv.prefetch(key for key in keys)
        assert await kv.invalidate("k1") == 2  # the generator's parents were linked


async def test_one_key_where_many_are_expected_is_a_type_error() -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put_many({"a": b"A", "b": b"B"})
        # a str or bytes would be taken as the keys of its characters (or byte values)
        with pytest.raises(TypeError):
            await kv.get_many("ab")
        with pytest.raises(TypeError):
            await kv.get_many(b"ab")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await kv.prefetch("ab")
        with pytest.raises(TypeError):
            await kv.put("c", b"C", parents="ab")
        with pytest.raises(TypeError, match="parents is an iterable of keys, not NoneType"):
            await kv.put("c", b"C", parents=None)  # type: ignore[arg-type]
        assert not await kv.contains("c")
        assert kv.metrics().dag_edges == 0


async def test_a_miss_storm_callback_that_cannot_be_called_is_refused() -> None:
    async with tierkv.open(l1_config()) as kv:
        for callback in (5, "alert"):
            with pytest.raises(TypeError, match="callable or None"):
                kv.on_miss_storm(callback)  # type: ignore[arg-type]
        kv.on_miss_storm(None)


async def test_full_l1_evicts_least_recently_used() -> None:
    async with tierkv.open(l1_config(capacity="16KiB", slot_size="4KiB")) as kv:
        for i in range(4):
            await kv.put(f"k{i}", bytes([i]) * 4096)
        await kv.get("k0")  # k1 is now the least recently used
        await kv.put("k4", b"new" * 1000)
        assert await kv.get("k1") is None
        assert await kv.get("k0") == bytes([0]) * 4096
        stats = kv.stats()
        assert stats["tiers"]["l1"]["used"] <= stats["tiers"]["l1"]["capacity"]
        assert stats["engine"]["evictions"] == {"l1": 1}


async def test_object_larger_than_every_tier_is_refused() -> None:
    async with tierkv.open(l1_config(capacity="16KiB", slot_size="4KiB")) as kv:
        await kv.put("small", b"s")
        with pytest.raises(tierkv.TierFullError):
            await kv.put("huge", bytes(17 * 1024))
        assert await kv.get("small") == b"s"
        assert not await kv.contains("huge")


async def test_pin_yields_the_resident_tensor_and_blocks_eviction() -> None:
    async with tierkv.open(l1_config(capacity="16KiB", slot_size="4KiB")) as kv:
        tensor = torch.arange(1024, dtype=torch.float32)
        await kv.put("p", tensor)
        async with kv.pin("p") as handle:
            assert handle.value.dtype == torch.float32 and handle.value.shape == (1024,)
            handle.value[0] = -1.0  # zero copy: this is the cached object itself
            for i in range(8):
                await kv.put(f"filler{i}", bytes(4096))
            assert await kv.locate("p") == "l1"
            assert kv.stats()["engine"]["pinned"] == 1
        got = await kv.get("p")
        assert isinstance(got, torch.Tensor) and got[0] == -1.0
        assert kv.stats()["engine"]["pinned"] == 0


async def test_pin_of_a_missing_key_raises_object_not_found() -> None:
    async with tierkv.open(l1_config()) as kv:
        with pytest.raises(tierkv.ObjectNotFound):
            async with kv.pin("missing"):
                pass
        with pytest.raises(KeyError):
            async with kv.pin("missing"):
                pass


async def test_idle_objects_leave_l1_after_ttl() -> None:
    async with tierkv.open(l1_config(ttl="50ms")) as kv:
        await kv.put("idle", b"x")
        await kv.put("pinned", b"y")
        async with kv.pin("pinned"):
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not await kv.contains("idle"):
                    break
            assert not await kv.contains("idle")
            assert await kv.contains("pinned")
        assert kv.stats()["engine"]["expired"] >= 1


async def test_concurrent_tasks_never_see_another_keys_bytes() -> None:
    async with tierkv.open(l1_config(capacity="64KiB", slot_size="1KiB")) as kv:

        async def worker(w: int) -> None:
            for i in range(200):
                key = f"k{(w * 7 + i) % 40}"
                if i % 3 == 0:
                    await kv.put(key, key.encode() * 50)
                else:
                    got = await kv.get(key)
                    assert got is None or got == key.encode() * 50

        await asyncio.gather(*(worker(w) for w in range(8)))


async def test_rewrite_returns_the_new_value_only() -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put("k", b"old")
        await kv.put("k", os.urandom(10) + b"new")
        got = await kv.get("k")
        assert isinstance(got, bytes) and got.endswith(b"new")
        assert kv.stats()["engine"]["objects"] == 1


async def test_bad_values_and_keys_are_type_errors() -> None:
    async with tierkv.open(l1_config()) as kv:
        with pytest.raises(TypeError):
            await kv.put("k", 12)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await kv.put(12, b"v")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await kv.put("k", torch.empty(3, device="meta"))  # shape and dtype, no data
        assert kv.stats()["engine"]["objects"] == 0


@pytest.mark.parametrize(
    ("slo", "error"),
    [
        pytest.param(True, TypeError, id="bool"),
        pytest.param("1", TypeError, id="str"),
        pytest.param(0, ValueError, id="zero"),
        pytest.param(-1.0, ValueError, id="negative"),
        pytest.param(math.nan, ValueError, id="nan"),
        pytest.param(math.inf, ValueError, id="inf"),
        pytest.param(10**400, ValueError, id="int-beyond-a-float"),
    ],
)
async def test_a_latency_slo_that_is_not_a_positive_finite_number_is_refused(
    slo: object, error: type[Exception]
) -> None:
    async with tierkv.open(l1_config()) as kv:
        await kv.put("k", b"old")
        with pytest.raises(error):
            await kv.put("k", b"new", latency_slo=slo)  # type: ignore[arg-type]
        assert await kv.get("k") == b"old"


async def test_unclosed_engine_warns() -> None:
    kv = await tierkv.open(l1_config())
    with pytest.warns(ResourceWarning):
        kv.__del__()
    await kv.close()
