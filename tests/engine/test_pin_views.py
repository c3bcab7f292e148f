"""A tensor lent by a pin keeps its slots for as long as it (or anything made from it) lives.

Misuse, but across tenants: tenant a keeps the view of a pinned block after the pin ends, the
block is deleted, tenant b's blocks fill the gpu tier. The view must keep reading a's bytes and
writing into it must never change what b gets.
"""

from __future__ import annotations

import gc

import torch

import tierkv
from tests.engine.conftest import l1_config


def unusable_slots(kv: tierkv.Engine) -> int:
    """Slots of the two that neither hold an object nor are free: lent out by a pin."""
    tier = kv.stats()["tiers"]["l1"]
    return int(tier["slots"] - tier["free_slots"] - tier["objects"])


async def test_a_view_kept_past_its_pin_never_aliases_another_tenants_block() -> None:
    config = l1_config(capacity="8KiB", slot_size="4KiB")  # two slots
    a_key = tierkv.block_keys([1, 2, 3, 4], block_size=4, model="m@1",
                              rope_theta=1e4, namespace=b"a")[0]
    b_keys = [tierkv.block_keys([i] * 4, block_size=4, model="m@1",
                                rope_theta=1e4, namespace=b"b")[0]
              for i in range(10, 16)]
    async with tierkv.open(config) as kv:
        await kv.put(a_key, torch.full((1000,), 7, dtype=torch.int32))
        async with kv.pin(a_key) as handle:
            view = handle.value
            part = handle.value[:10]  # made from the view while pinned
        del handle
        await kv.delete(a_key)
        for i, key in enumerate(b_keys):
            await kv.put(key, torch.full((1000,), i, dtype=torch.int32))
        await kv.settle()
        assert torch.equal(view, torch.full((1000,), 7, dtype=torch.int32))
        view.fill_(-1)
        part.fill_(-2)
        for i, key in enumerate(b_keys):
            got = await kv.get(key)
            assert got is None or (isinstance(got, torch.Tensor)
                                   and torch.equal(got, torch.full((1000,), i, dtype=torch.int32)))
        # the lent slot is still reserved: the tier works with the one left
        assert unusable_slots(kv) == 1
        del view
        gc.collect()
        assert unusable_slots(kv) == 1  # `part` still holds it
        del part
        gc.collect()
        await kv.settle()
        assert unusable_slots(kv) == 0
        await kv.put(b"after", b"x" * 4000)
        assert await kv.get(b"after") == b"x" * 4000


async def test_a_key_changed_while_pinned_releases_the_pin_it_took() -> None:
    """A mutable key (a bytearray) changed inside the pin: the pin is released under the key it
    was taken for (it was encoded again on release: a KeyError out of the block, and the
    object stayed pinned, never evicted, for the engine's life)."""
    async with tierkv.open(l1_config(capacity="8KiB", slot_size="4KiB")) as kv:
        await kv.put(b"key1", b"v" * 4000)
        key = bytearray(b"key1")
        async with kv.pin(key):  # type: ignore[arg-type] # encode_key takes it
            key[:] = b"key2"
        assert kv.metrics().pinned == 0
        assert kv.stats()["tiers"]["l1"]["pinned"] == 0
        assert await kv.delete(b"key1")
        assert unusable_slots(kv) == 0 and kv.stats()["tiers"]["l1"]["free_slots"] == 2
