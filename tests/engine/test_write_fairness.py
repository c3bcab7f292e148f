"""Writes served from memory give the event loop turns: a task putting or deleting in a loop
does not keep the application's other tasks (and the engine's evictors) from running, and a
write cancelled at such a turn changes nothing and leaves nothing behind (but its count in
`cancelled_calls`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import tierkv
from tests.engine._configs import KiB, MiB, hierarchy_config

COUNT = 1600


def _roomy_gpu(directory: Path) -> dict[str, object]:
    """A first tier that holds every object of the test: no put waits for space."""
    return hierarchy_config(directory, ("gpu",), gpu={"capacity": 64 * MiB, "slot_size": 4 * KiB})


async def test_a_loop_of_writes_lets_other_tasks_run(tmp_path: Path) -> None:
    async with tierkv.open(_roomy_gpu(tmp_path)) as kv:
        turns = 0

        async def other_task() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other_task())
        await asyncio.sleep(0)
        try:
            turns = 0
            for i in range(COUNT):
                await kv.put(b"k%d" % i, b"v" * 4096)
            after_puts = turns
            turns = 0
            for i in range(COUNT):
                await kv.delete(b"k%d" % i)  # held
            after_deletes = turns
            turns = 0
            for i in range(COUNT):
                await kv.delete(b"absent%d" % i)  # not held: nothing to do at all
            after_misses = turns
        finally:
            ticker.cancel()
        # one turn every 16 writes at the least (tierkv.engine._call.WRITES_PER_TURN)
        assert after_puts >= COUNT // 16 - 1
        assert after_deletes >= COUNT // 16 - 1
        assert after_misses >= COUNT // 16 - 1


async def test_a_write_cancelled_at_its_turn_changes_nothing(tmp_path: Path) -> None:
    async with tierkv.open(_roomy_gpu(tmp_path)) as kv:
        await kv.put(b"kept", b"old")
        cancelled = 0
        for i in range(64):
            key = b"k%d" % i
            put = asyncio.create_task(kv.put(key, b"new"))
            await asyncio.sleep(0)  # the put runs to its first suspension, if any
            if put.done():
                await put
                continue
            put.cancel()
            try:
                await put
            except asyncio.CancelledError:
                cancelled += 1
                assert await kv.get(key) is None
        assert cancelled >= 3
        kept = [b"kept%d" % i for i in range(64)]
        await kv.put_many([(key, b"old") for key in kept])
        deletes = 0
        for key in kept:
            delete = asyncio.create_task(kv.delete(key))
            await asyncio.sleep(0)
            if delete.done():
                assert await delete
                continue
            delete.cancel()
            try:
                await delete
            except asyncio.CancelledError:
                deletes += 1
                assert await kv.get(key) == b"old"
        assert deletes >= 3
        assert kv.metrics().cancelled_calls == cancelled + deletes
        assert await kv.get(b"kept") == b"old"
    # close waited for no call the cancellations left counted as running
    await asyncio.wait_for(kv.close(), 10)
