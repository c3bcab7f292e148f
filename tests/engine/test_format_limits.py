"""What the on-media format cannot record and read back is refused at the public call.

An object header holds at most `MAX_PARENTS` parents and a `MAX_BODY` body, a tensor at most
`MAX_DIMS` dimensions (`tierkv.formats`). A put or an `add_dependency` beyond them raises
`LimitExceededError` before anything changes (no DAG edge, no index entry, no tier write);
what was acknowledged, up to the limits, is found byte for byte after a flush and a reopen of
the pmem and the nvme tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tierkv
from tests.engine._configs import hierarchy_config
from tests.engine.conftest import l1_config
from tierkv import LimitExceededError
from tierkv.formats.header import MAX_PARENTS
from tierkv.formats.value import MAX_DIMS

MiB = 1 << 20
#: parents whose keys take 1.02 MB of the header body: within its 1 MiB, with no room for one
#: more of them
FITTING = [b"%d:" % i + b"p" * 60_000 for i in range(17)]
#: parents whose keys take 1.2 MB: beyond it, although they are far fewer than 4096
TOO_LARGE = [b"%d:" % i + b"q" * 60_000 for i in range(20)]
TOO_MANY = [b"r%d" % i for i in range(MAX_PARENTS + 1)]
DEEP = torch.arange(6, dtype=torch.float32).reshape([1] * (MAX_DIMS - 2) + [2, 3])
TOO_DEEP = DEEP.reshape([1] * (MAX_DIMS - 1) + [2, 3])

DURABLE = [
    pytest.param(kinds, policy, id=f"{'-'.join(kinds)}-{policy}")
    for kinds in (("gpu", "pmem"), ("gpu", "nvme"))
    for policy in ("write_back", "write_through")
]


def config(tmp: Path, kinds: tuple[str, ...], policy: str) -> dict[str, Any]:
    # 4 MiB regions: an entry with a header of nearly 1 MiB fits one
    return hierarchy_config(tmp, kinds, write_policy=policy,
                            nvme={"capacity": 32 * MiB, "region_size": 4 * MiB})


async def test_a_put_beyond_the_header_is_refused_before_anything_changes() -> None:
    async with tierkv.open(l1_config(capacity="256KiB")) as kv:
        await kv.put("k", b"old")
        edges = kv.metrics().dag_edges
        for parents in (TOO_LARGE, TOO_MANY):
            for key in ("k", "new"):
                with pytest.raises(LimitExceededError) as info:
                    await kv.put(key, b"v", parents=parents)
                assert isinstance(info.value, ValueError)
        with pytest.raises(LimitExceededError):
            await kv.put("new", TOO_DEEP)
        assert await kv.get("k") == b"old"
        assert not await kv.contains("new")
        assert kv.metrics().dag_edges == edges
        assert kv.metrics().objects == 1


async def test_add_dependency_beyond_the_header_is_refused_before_anything_changes() -> None:
    async with tierkv.open(l1_config(capacity="256KiB")) as kv:
        await kv.put("child", b"c")
        for i in range(MAX_PARENTS):
            await kv.add_dependency(b"p%d" % i, "child")
        with pytest.raises(LimitExceededError):
            await kv.add_dependency(b"one-too-many", "child")
        assert kv.metrics().dag_edges == MAX_PARENTS
        assert await kv.invalidate(b"one-too-many") == 0
        assert await kv.get("child") == b"c"
        # an edge already in the header, and one to a key not stored, are no header change
        await kv.add_dependency(b"p0", "child")
        await kv.add_dependency(b"one-too-many", "not-stored")
        assert await kv.invalidate(b"p4095") == 1


async def test_add_dependency_to_a_key_not_stored_has_the_headers_bound() -> None:
    """A key not stored takes at most as many parents as a header holds: beyond the record of
    departed edges' own bound, every flush and close raised a `ValueError`."""
    async with tierkv.open(l1_config(capacity="256KiB")) as kv:
        for i in range(MAX_PARENTS):
            await kv.add_dependency(b"p%d" % i, "absent")
        with pytest.raises(LimitExceededError):
            await kv.add_dependency(b"one-too-many", "absent")
        await kv.add_dependency(b"p0", "absent")  # an edge it has: no change
        assert kv.metrics().dag_edges == MAX_PARENTS
        await kv.flush()


@pytest.mark.pmem
@pytest.mark.parametrize(("kinds", "policy"), DURABLE)
async def test_what_fits_survives_a_reopen_and_what_was_refused_left_nothing(
    tmp_path: Path, kinds: tuple[str, ...], policy: str
) -> None:
    cfg = config(tmp_path, kinds, policy)
    async with tierkv.open(cfg) as kv:
        await kv.put(b"kept", b"precious", parents=FITTING)
        await kv.put(b"deep", DEEP)
        for parents in (TOO_LARGE, TOO_MANY):
            with pytest.raises(LimitExceededError):
                await kv.put(b"kept", b"overwrite", parents=parents)
            with pytest.raises(LimitExceededError):
                await kv.put(b"refused", b"v", parents=parents)
        with pytest.raises(LimitExceededError):
            await kv.put(b"refused", TOO_DEEP)
        await kv.flush()  # the refused puts left nothing that cannot be written down
    async with tierkv.open(cfg) as kv:
        assert await kv.get(b"kept") == b"precious"
        deep = await kv.get(b"deep")
        assert isinstance(deep, torch.Tensor) and torch.equal(deep, DEEP)
        assert not await kv.contains(b"refused")
        assert kv.metrics().dag_edges == len(FITTING)
        assert await kv.invalidate(TOO_LARGE[0]) == 0 and await kv.invalidate(TOO_MANY[0]) == 0
        assert await kv.invalidate(FITTING[-1]) == 1  # the edges the header recorded
        assert not await kv.contains(b"kept")


@pytest.mark.pmem
@pytest.mark.parametrize(("kinds", "policy"), DURABLE)
async def test_add_dependency_refuses_the_edge_that_would_lose_a_durable_child(
    tmp_path: Path, kinds: tuple[str, ...], policy: str
) -> None:
    cfg = config(tmp_path, kinds, policy)
    async with tierkv.open(cfg) as kv:
        await kv.put(b"child", b"durable value")
        await kv.flush()
        for parent in FITTING:
            await kv.add_dependency(parent, b"child")
        for parent in TOO_LARGE:
            with pytest.raises(LimitExceededError):
                await kv.add_dependency(parent, b"child")
        assert kv.metrics().dag_edges == len(FITTING)
    async with tierkv.open(cfg) as kv:
        assert await kv.get(b"child") == b"durable value"
        assert await kv.invalidate(TOO_LARGE[0]) == 0
        assert await kv.invalidate(FITTING[-1]) == 1


def _largest_held(tier: Any) -> int:
    """The largest payload `tier` says it can ever hold (with a header within its allowance)."""
    low, high = 0, 64 * MiB
    while low < high:
        middle = (low + high + 1) // 2
        if tier.can_ever_hold(middle):
            low = middle
        else:
            high = middle - 1
    return low


@pytest.mark.parametrize(("kinds", "policy"), DURABLE)
async def test_a_long_header_an_object_would_not_fit_with_is_refused_up_front(
        tmp_path: Path, kinds: tuple[str, ...], policy: str) -> None:
    """An object just under a persistent tier's limit by its payload, over it with its long
    key's header: taken as fitting, it was refused at every demotion and flush, for good
    (each `flush()` and `close()` raised `TierFullError`), and a write-through overwrite of a
    key lost the old value. It is refused before anything changes; a long key on a smaller
    payload is stored; the gpu tier, which keeps no header, takes what its slots hold whatever
    the key."""
    long_key = "L" * 60_000
    base = hierarchy_config(tmp_path, kinds, write_policy=policy,
                            gpu={"capacity": 16 * MiB, "slot_size": MiB},
                            nvme={"capacity": 8 * MiB, "region_size": MiB})
    async with tierkv.open(base) as kv:
        size = _largest_held(kv.tiers[1])
        await kv.put(long_key, b"old")
        with pytest.raises(tierkv.TierFullError, match="header"):
            await kv.put(long_key, bytes(size))
        with pytest.raises(tierkv.TierFullError, match="header"):
            await kv.put_many([("other", b"x"), (long_key, bytes(size))])
        assert await kv.get(long_key) == b"old"
        assert not await kv.contains("other")  # put_many checks every item first
        await kv.put(long_key + "-small", bytes(size // 2))
        await kv.flush()
    async with tierkv.open(base) as kv:
        assert await kv.get(long_key) == b"old"
        assert await kv.get(long_key + "-small") == bytes(size // 2)
    gpu_only = {"tiers": [{"name": "gpu", "kind": "gpu", "device": "cpu",
                           "capacity": 64 * 1024, "slot_size": 4096}]}
    async with tierkv.open(gpu_only) as kv:
        await kv.put("G" * 2000, bytes(64 * 1024))  # the whole tier, by its payload
        assert kv.metrics().objects == 1
