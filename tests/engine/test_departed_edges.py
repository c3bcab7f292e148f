"""Invalidation through a key whose object left, across a restart (`engine._departed`).

In a → b → c the edge a → b lives in b's header only; b deleted or dropped while c stays, the
engine keeps the edge in memory and records it: each flush (a close flushes), and a delete or
drop of b before b's last copy goes. After a clean restart or a `kill -9`, a new value or an
invalidation of a still removes c: no stale derived value is served.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tierkv
from tests.engine._configs import hierarchy_config
from tests.engine.test_invalidation import ROOT, killed_after
from tierkv.testing.faults import FaultPlan, open_with_faults

pytestmark = pytest.mark.pmem

ALL = ("gpu", "pmem", "nvme")


def _config(tmp_path: Path, kinds: tuple[str, ...] = ALL, policy: str = "write_back"
            ) -> dict[str, Any]:
    return hierarchy_config(tmp_path, kinds, write_policy=policy)


async def _chain_with_its_middle_gone(kv: tierkv.Engine,
                                      before_delete: Callable[[], object] = lambda: None
                                      ) -> None:
    """a → b → c → d and x → b (two parents), then b deleted: c and d derive from a and x
    through b."""
    await kv.put(b"a", b"A")
    await kv.put(b"x", b"X")
    await kv.put(b"b", b"B", parents=[b"a", b"x"])
    await kv.put(b"c", b"C", parents=[b"b"])
    await kv.put(b"d", b"D", parents=[b"c"])
    before_delete()
    await kv.delete(b"b")


@pytest.mark.parametrize("kinds", [ALL, ("pmem",), ("nvme",)], ids="-".join)
@pytest.mark.parametrize("how", ["invalidate", "overwrite"])
async def test_a_restart_keeps_the_edges_through_a_key_that_left(
        tmp_path: Path, kinds: tuple[str, ...], how: str) -> None:
    cfg = _config(tmp_path, kinds)
    async with tierkv.open(cfg) as kv:
        await _chain_with_its_middle_gone(kv)
    async with tierkv.open(cfg) as kv:
        assert [await kv.get(key) for key in (b"c", b"d")] == [b"C", b"D"]
        if how == "invalidate":
            assert await kv.invalidate(b"a") == 3  # a, c, d
        else:
            await kv.put(b"a", b"A2")  # a new value: what derived from the old one goes
        assert [await kv.get(key) for key in (b"c", b"d")] == [None, None]
        assert await kv.get(b"x") == b"X"
    async with tierkv.open(cfg) as kv:  # and the removal holds across the next restart
        assert [await kv.get(key) for key in (b"c", b"d")] == [None, None]
        # nothing derives from b any more: its edges are forgotten, and so is the record
        assert (kv.metrics().dag_nodes, kv.metrics().dag_edges) == (0, 0)


async def test_the_second_parent_reaches_through_too(tmp_path: Path) -> None:
    cfg = _config(tmp_path, ("pmem",))
    async with tierkv.open(cfg) as kv:
        await _chain_with_its_middle_gone(kv)
    async with tierkv.open(cfg) as kv:
        assert await kv.invalidate(b"x") == 3  # x, c, d
        assert await kv.get(b"a") == b"A"


async def test_edges_of_a_key_nothing_derives_from_any_more_are_forgotten(
        tmp_path: Path) -> None:
    cfg = _config(tmp_path, ("pmem",))
    async with tierkv.open(cfg) as kv:
        await _chain_with_its_middle_gone(kv)
        await kv.flush()  # the record names b
        await kv.delete(b"c")
        await kv.delete(b"d")  # b's edges go with its last descendant
    async with tierkv.open(cfg) as kv:
        assert (kv.metrics().dag_nodes, kv.metrics().dag_edges) == (0, 0)
        await kv.put(b"c", b"C again", parents=[b"b"])
        await kv.put(b"a", b"A2")
        assert await kv.get(b"c") == b"C again"  # not derived from a: no stale edge came back


_KILLED_WRITER = textwrap.dedent("""
    import asyncio, json, sys, time
    import tierkv
    config = json.loads(sys.argv[1])

    async def main():
        kv = await tierkv.open(config)
        await kv.put(b"a", b"A")
        await kv.put(b"b", b"B" * 3000, parents=[b"a"])
        await kv.put(b"c", b"C" * 3000, parents=[b"b"])
        await kv.delete(b"b")
        await kv.flush()
        print("FLUSHED", flush=True)
        time.sleep(300)  # killed here, never closed

    asyncio.run(main())
""")


@pytest.mark.crash
@pytest.mark.parametrize("kinds", [ALL, ("gpu", "nvme")], ids="-".join)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_edges_a_flush_recorded_survive_kill_9(
        tmp_path: Path, policy: str, kinds: tuple[str, ...]) -> None:
    cfg = _config(tmp_path, kinds, policy)
    assert killed_after(_KILLED_WRITER, cfg, 1) == [["FLUSHED"]]

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            assert await kv.get(b"b") is None
            assert await kv.get(b"c") == b"C" * 3000
            assert await kv.invalidate(b"a") == 2  # a and c
            assert await kv.get(b"c") is None

    asyncio.run(reopen())


_KILLED_AFTER_A_DEPARTURE = textwrap.dedent("""
    import asyncio, json, sys, time
    import tierkv
    config, how = json.loads(sys.argv[1]), sys.argv[2]

    async def main():
        kv = await tierkv.open(config)
        await kv.put(b"a", b"A")
        await kv.put(b"b", b"B" * 3000, parents=[b"a"])
        await kv.put(b"c", b"C" * 3000, parents=[b"b"])
        await kv.put(b"y", b"Y" * 3000, parents=[b"x"])  # x is never stored
        await kv.flush()  # all durable; no key has left yet: the record is empty
        if how == "delete":
            await kv.delete(b"b")
        elif how == "link":
            await kv.add_dependency(b"p", b"x")
        else:  # dropped for room: b, never read, goes first out of the only tier
            for i in range(64):
                await kv.put(b"filler%d" % i, bytes(512 << 10))
                for key in (b"a", b"c", b"y"):
                    await kv.get(key)
                if not await kv.contains(b"b"):
                    break
            await kv.settle()
        print("DONE", await kv.contains(b"b"), flush=True)
        time.sleep(300)  # killed here, with no flush since the departure or the link

    asyncio.run(main())
""")


@pytest.mark.crash
@pytest.mark.parametrize(("how", "kinds", "policy"), [
    ("delete", ALL, "write_back"), ("delete", ALL, "write_through"),
    ("delete", ("pmem",), "write_back"), ("link", ALL, "write_back"),
    ("link", ("gpu", "nvme"), "write_through"), ("drop", ("pmem",), "write_back")],
    ids=lambda value: value if isinstance(value, str) else "-".join(value))
def test_edges_are_on_media_before_the_departure_or_link_returns(
        tmp_path: Path, how: str, kinds: tuple[str, ...], policy: str) -> None:
    """A key that leaves with parents and children (deleted, dropped for room) has its edges
    recorded before its last copy goes, and an edge to a key not stored before
    `add_dependency` returns: after a `kill -9` with no flush since, an invalidation of the
    root still reaches what derives from it. (They were recorded at the next flush only.)"""
    cfg = _config(tmp_path, kinds, policy)
    with subprocess.Popen([sys.executable, "-c", _KILLED_AFTER_A_DEPARTURE, json.dumps(cfg),
                           how], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as writer:
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline().split() == ["DONE", str(how == "link")]
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(30)

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            assert [await kv.get(key) for key in (b"c", b"y")] == [b"C" * 3000, b"Y" * 3000]
            if how == "link":
                assert await kv.invalidate(b"p") == 1  # y, through x
                assert [await kv.get(key) for key in (b"c", b"y")] == [b"C" * 3000, None]
            else:
                assert await kv.get(b"b") is None
                assert await kv.invalidate(b"a") == 2  # a and c, through b
                assert [await kv.get(key) for key in (b"c", b"y")] == [None, b"Y" * 3000]

    asyncio.run(reopen())


async def test_a_key_dropped_for_room_keeps_its_edges_across_a_restart(tmp_path: Path) -> None:
    """b, the oldest and never read, is dropped out of the only tier by puts that need its
    room, while a and c are read and stay."""
    cfg = _config(tmp_path, ("pmem",))
    async with tierkv.open(cfg) as kv:
        await kv.put(b"a", b"A")
        await kv.put(b"b", bytes(1 << 20), parents=[b"a"])
        await kv.put(b"c", b"C", parents=[b"b"])
        for i in range(64):
            await kv.put(b"filler%d" % i, bytes(512 << 10))
            await kv.get(b"a")
            await kv.get(b"c")
            if not await kv.contains(b"b"):
                break
        await kv.settle()
        assert not await kv.contains(b"b") and await kv.get(b"c") == b"C"
    async with tierkv.open(cfg) as kv:
        assert await kv.invalidate(b"a") == 2  # a and c
        assert await kv.get(b"c") is None


async def test_a_record_no_tier_takes_fails_no_flush_and_the_next_flush_writes_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)  # the injected faults are logged as warnings
    cfg = _config(tmp_path, ("pmem",))
    plan = FaultPlan.parse("pmem:enospc=1;ops=put", seed=1)
    plan.enabled = False
    kv = await open_with_faults(cfg, plan)
    try:
        # from the delete on, the pool refuses every write: the record's too
        await _chain_with_its_middle_gone(kv, lambda: setattr(plan, "enabled", True))
        assert await kv.get(b"b") is None  # the delete does not fail for the record
        await kv.flush()  # every object is durable: the flush does not fail for it either
        plan.enabled = False
        assert kv.stats()["engine"]["departed_edges_unrecorded"] == 2
        await kv.flush()  # written now
    finally:
        plan.enabled = False
        await kv.close()
    async with tierkv.open(cfg) as kv:
        assert await kv.invalidate(b"a") == 3  # a, c, d


async def test_an_engine_that_never_flushes_forgets_keys_whose_edges_went(
        tmp_path: Path) -> None:
    """Each round leaves 2,000 keys with children (b deleted under c), then removes the children
    (c deleted, and b's edges with it), with no flush between: what the engine keeps to record
    at the next flush does not grow with the rounds."""
    cfg = {"tiers": [{"name": "l1", "kind": "gpu", "device": "cpu", "capacity": "4MiB",
                      "slot_size": "1KiB"}]}
    async with tierkv.open(cfg) as kv:
        held: list[int] = []
        tracemalloc.start()
        try:
            for round_ in range(4):
                keys = [b"r%d-%d-" % (round_, i) for i in range(2000)]
                for key in keys:
                    await kv.put(key + b"a", b"A")
                    await kv.put(key + b"b", b"B", parents=[key + b"a"])
                    await kv.put(key + b"c", b"C", parents=[key + b"b"])
                    await kv.delete(key + b"b")
                for key in keys:
                    await kv.delete(key + b"c")
                    await kv.delete(key + b"a")
                del keys
                gc.collect()
                held.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
        assert (kv.metrics().dag_nodes, kv.metrics().dag_edges) == (0, 0)
    # a key kept per departure would add ~2,000 keys (~100 bytes each) a round
    assert held[3] < held[1] + 100_000, held


async def test_a_departed_key_whose_last_child_names_other_parents_is_released(
        tmp_path: Path) -> None:
    """a -> b -> c, b deleted (its edges kept: c derives from it), then c put again naming
    no parents: nothing derives from b any more, so b and a -> b go. They stayed for the
    engine's life (a node and an edge per such put, recorded at every flush), and a later
    `add_dependency(b, d)` made `invalidate(a)` remove d."""
    async with tierkv.open(_config(tmp_path, ("gpu", "pmem"))) as kv:
        baseline = kv.metrics()
        await kv.put(b"a", b"A")
        await kv.put(b"b", b"B", parents=[b"a"])
        await kv.put(b"c", b"C", parents=[b"b"])
        await kv.delete(b"b")
        assert kv.metrics().dag_edges == baseline.dag_edges + 2  # kept for c
        await kv.put(b"c", b"C2")
        assert kv.metrics().dag_edges == baseline.dag_edges
        assert kv.metrics().dag_nodes == baseline.dag_nodes
        await kv.put(b"d", b"D")
        await kv.add_dependency(b"b", b"d")
        assert await kv.invalidate(b"a") == 1  # a alone: d does not derive from a
        assert await kv.get(b"d") == b"D"


@pytest.mark.parametrize("kinds", [("pmem",), ("nvme",)], ids="-".join)
async def test_what_derives_from_a_damaged_object_goes_at_open(
        tmp_path: Path, kinds: tuple[str, ...]) -> None:
    """a -> b -> c, b's payload damaged on media while the engine was closed: b's parents were
    written in its record only, so nothing after the open knew c derives from a, and c
    survived a new value of a, also after every later restart. What derives from a damaged
    object whose parents are unknown goes at the open (a miss, never a stale derivation); a
    log closed cleanly keeps them in its checkpoint, and finds the damage at the read."""
    config = _config(tmp_path, kinds)
    marker = bytes(range(256)) * 12
    async with tierkv.open(config) as kv:
        await kv.put(b"a", b"A" * 3000)
        await kv.put(b"b", marker, parents=[b"a"])
        await kv.put(b"c", b"C" * 3000, parents=[b"b"])
    media = tmp_path / ("tierkv.pool" if kinds == ("pmem",) else "tierkv.log")
    data = bytearray(await asyncio.to_thread(media.read_bytes))
    at = data.find(marker)
    assert at >= 0 and data.find(marker, at + 1) < 0
    data[at + 100] ^= 0x10
    await asyncio.to_thread(media.write_bytes, bytes(data))
    for _reopen in range(2):
        async with tierkv.open(config) as kv:
            assert await kv.get(b"b") is None
            await kv.put(b"a", b"new")  # a new value of a: nothing derived from the old stays
            assert await kv.get(b"c") is None


@pytest.mark.parametrize("kinds", [("pmem",), ("nvme",)], ids="-".join)
async def test_what_derives_from_a_departed_key_goes_if_the_edges_record_is_damaged(
        tmp_path: Path, kinds: tuple[str, ...]) -> None:
    """a -> b -> c, b deleted (a -> b recorded on media), then the record damaged while the
    engine was closed: it was skipped with a warning, and c survived a new value of a. With
    every copy of the record unreadable, what derives from a key that holds no object goes."""
    config = _config(tmp_path, kinds)
    async with tierkv.open(config) as kv:
        await kv.put(b"a", b"A" * 3000)
        await kv.put(b"b", b"B" * 3000, parents=[b"a"])
        await kv.put(b"c", b"C" * 3000, parents=[b"b"])
        await kv.delete(b"b")
    media = tmp_path / ("tierkv.pool" if kinds == ("pmem",) else "tierkv.log")
    data = bytearray(await asyncio.to_thread(media.read_bytes))
    at = data.find(b"TKDE")  # the record's magic (`formats.departed_edges`)
    assert at >= 0
    while at >= 0:
        data[at + 10] ^= 0x04
        at = data.find(b"TKDE", at + 1)
    await asyncio.to_thread(media.write_bytes, bytes(data))
    async with tierkv.open(config) as kv:
        await kv.put(b"a", b"new")
        assert await kv.get(b"c") is None


@pytest.mark.parametrize("kinds", [ALL, ("pmem",)], ids="-".join)
async def test_a_put_keeps_the_edges_of_a_parent_its_own_cascade_leaves_childless(
        tmp_path: Path, kinds: tuple[str, ...]) -> None:
    """d holds no object and derives from a (`add_dependency`); c, not stored either, has a
    child b that also derives from d. A put of c derived from d removes b (c's old children),
    which left d without children while c was not linked to it yet: d's edge from a went, and
    an invalidation of a missed c."""
    async with tierkv.open(_config(tmp_path, kinds)) as kv:
        await kv.put(b"b", b"B", parents=[b"d"])
        await kv.add_dependency(b"c", b"b")
        await kv.add_dependency(b"a", b"d")
        await kv.put(b"c", b"C", parents=[b"d"])
        assert await kv.get(b"b") is None
        with pytest.raises(tierkv.DependencyCycleError):
            await kv.add_dependency(b"c", b"a")  # a -> d -> c
        assert await kv.invalidate(b"a") == 1
        assert await kv.get(b"c") is None


_KILLED_WITH_A_VOLATILE_MIDDLE = textwrap.dedent("""
    import asyncio, json, sys
    import tierkv
    config, how = json.loads(sys.argv[1]), sys.argv[2]

    async def main():
        kv = await tierkv.open(config)
        await kv.put(b"a", b"A" * 20000)  # larger than the first tier: on media at once
        await kv.put(b"x", b"X" * 20000)
        await kv.flush()
        await kv.put(b"b", b"B" * 100, parents=[b"a"])  # in the first tier only
        if how == "add_dependency":
            await kv.put(b"c", b"C" * 20000)
            await kv.put(b"d", b"D" * 20000, parents=[b"c"])  # c on media has a child
            await kv.add_dependency(b"b", b"c")  # "on media when this returns"
        else:
            await kv.put(b"c", b"C" * 20000, parents=[b"b"])  # on media below it
        if how == "new_parent":  # a parent for b, whose only copy is volatile
            await kv.add_dependency(b"x", b"b")
        print("PUT", *[await kv.locate(key) for key in (b"a", b"b", b"c")], flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


@pytest.mark.parametrize("how", ["put", "add_dependency", "new_parent"])
def test_a_crash_keeps_the_edges_a_volatile_middle_key_held(tmp_path: Path, how: str) -> None:
    """a (on media) -> b (in the gpu tier only, write_back) -> c (on media), then `kill -9`:
    b is lost, as write_back allows, and c comes back naming b in its header. The edge a -> b
    was in b's header only: invalidate(a) reached nothing, and c stayed readable. So was an
    edge x -> b that `add_dependency` made once c was on media."""
    cfg = _config(tmp_path, ("gpu", "pmem"))
    cfg["tiers"][0].update(slot_size=4096, capacity=16 * 1024)
    script = _KILLED_WITH_A_VOLATILE_MIDDLE.replace("sys.argv[2]", repr(how))
    assert killed_after(script, cfg, 1) == [["PUT", "pmem", "gpu", "pmem"]]

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            assert await kv.get(b"b") is None
            assert await kv.get(b"c") == b"C" * 20000
            removed = await kv.invalidate(b"x" if how == "new_parent" else b"a")
            assert removed == (3 if how == "add_dependency" else 2)  # and c (and d)
            assert await kv.get_many([b"c", b"d"]) == [None, None]

    asyncio.run(reopen())


_KILLED_WITH_A_MIDDLE_KEY_IN_THE_LOGS_BUFFER = textwrap.dedent("""
    import asyncio, json, sys
    import tierkv
    config = json.loads(sys.argv[1])

    async def main():
        kv = await tierkv.open(config)
        await kv.put(b"a", b"A" * 20000)  # larger than the first tier's slots: the pool
        await kv.flush()
        # the slowest tier meets a lax SLO: the log's buffer, written at the next flush
        await kv.put(b"b", b"B" * 20000, parents=[b"a"], latency_slo=30.0)
        await kv.put(b"c", b"C" * 20000, parents=[b"b"])  # the pool: on media at once
        print("PUT", *[await kv.locate(key) for key in (b"a", b"b", b"c")], flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def test_a_crash_keeps_the_edges_of_a_key_the_log_had_not_written(tmp_path: Path) -> None:
    """a (pool) -> b (the log's buffer only, write_back) -> c (pool), then `kill -9`: b is
    lost with the buffer, c comes back. A copy in the log counted as on media, so no record
    held a -> b, and invalidate(a) left c readable."""
    cfg = _config(tmp_path)
    cfg["tiers"][0].update(slot_size=4096, capacity=16 * 1024)
    assert killed_after(_KILLED_WITH_A_MIDDLE_KEY_IN_THE_LOGS_BUFFER, cfg, 1) == [
        ["PUT", "pmem", "nvme", "pmem"]]

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            assert await kv.get(b"b") is None
            assert await kv.get(b"c") == b"C" * 20000
            assert await kv.invalidate(b"a") == 2  # and c
            assert await kv.get(b"c") is None

    asyncio.run(reopen())


_KILLED_BELOW_A_HOT_PREFIX = textwrap.dedent("""
    import asyncio, json, sys
    import tierkv
    config = json.loads(sys.argv[1])
    KEYS = tierkv.block_keys(list(range(8 * 16)), block_size=16, model="m@1", rope_theta=1e4)

    async def main():
        kv = await tierkv.open(config)
        await kv.put_many([(key, bytes([i]) * 3000) for i, key in enumerate(KEYS[:2])])
        for _ in range(20):  # a hot prefix block: the gpu tier keeps it
            await kv.get(KEYS[1])
        for i in range(2, len(KEYS)):
            await kv.put(KEYS[i], bytes([i]) * 3000, parents=[KEYS[i - 1]])
        await kv.settle()
        print(*[await kv.locate(key) for key in KEYS], flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def test_a_crash_keeps_a_chain_below_a_hot_prefix_linked(tmp_path: Path) -> None:
    """A `block_keys` chain whose first blocks the gpu tier keeps (read often) while the
    evictor moves the later ones down: after a `kill -9`, an invalidation of the first block
    reaches every block that came back, also those below blocks the crash lost."""
    cfg = _config(tmp_path, ("gpu", "pmem"))
    cfg["tiers"][0].update(slot_size=4096, capacity=16 * 1024)
    [placed] = killed_after(_KILLED_BELOW_A_HOT_PREFIX, cfg, 1)
    assert "gpu" in placed[2:] and "pmem" in placed[2:]  # some moved down, some stayed
    keys = tierkv.block_keys(list(range(8 * 16)), block_size=16, model="m@1", rope_theta=1e4)

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            back = [await kv.get(key) is not None for key in keys]
            assert back[0] and sum(back) > 2
            assert await kv.invalidate(keys[0]) == sum(back)
            assert await kv.get_many(keys) == [None] * len(keys)

    asyncio.run(reopen())


_KILLED_AFTER_A_RECORD_FAILED = textwrap.dedent("""
    import asyncio, json, sys
    from tierkv.testing.faults import FaultPlan, open_with_faults
    config = json.loads(sys.argv[1])

    async def main():
        plan = FaultPlan(seed=1)
        # the first write into each persistent tier fails: the record ahead of c's copy
        plan.add("pmem", "eio", schedule=[1], ops=["put"])
        plan.add("nvme", "eio", schedule=[1], ops=["put"])
        plan.enabled = False
        kv = await open_with_faults(config, plan)
        await kv.put("a", b"A1" * 1000)
        await kv.put("b", b"B1" * 1000, parents=["a"])
        await kv.put("c", b"C1" * 1000, parents=["b"])
        plan.enabled = True
        for _ in range(40):  # a and b stay hot in the gpu tier; c's TTL moves it down
            await kv.get_many(["a", "b"])
            await asyncio.sleep(0.05)
        print(kv.stats()["engine"]["departed_edges_unrecorded"], flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def test_a_copy_whose_ancestors_edges_no_tier_took_is_not_written_below_them(
        tmp_path: Path) -> None:
    """The record ahead of c's move down failed on both persistent tiers (EIO): c was moved
    all the same, and after a `kill -9` a new value of a left c readable. The move now fails
    and is made again once the record is written."""
    cfg = hierarchy_config(tmp_path, ALL, gpu={"capacity": 512 << 10, "slot_size": 64 << 10,
                                               "ttl": "0.4s"})
    assert killed_after(_KILLED_AFTER_A_RECORD_FAILED, cfg, 1) == [["1"]]

    async def reopen() -> None:
        async with tierkv.open(cfg) as kv:
            await kv.put("a", b"A2" * 1000)
            assert await kv.get("c") is None

    asyncio.run(reopen())
