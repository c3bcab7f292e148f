"""The native library's job queue on its own: the workers a loop turn's jobs need are woken once
(`tkv_queue_kick`), and no job is ever left without a worker to take it, whatever number a turn
submits and however many workers sleep."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from tierkv.tiers._native import load_queue
from tierkv.tiers._native_queue import NativeQueue

pytestmark = pytest.mark.native


@pytest.mark.parametrize(("workers", "depth"), [(1, 4), (2, 16), (4, 3)])
async def test_every_job_of_every_turn_runs(workers: int, depth: int) -> None:
    calls = load_queue()
    assert calls is not None
    queue = NativeQueue(calls, asyncio.get_running_loop(), workers, depth)
    rng = random.Random(f"{workers}-{depth}")
    try:
        for _ in range(200):
            count = rng.randint(1, 24)  # beyond depth: the rest wait for slots, then submit
            sources = [np.frombuffer(rng.randbytes(rng.randint(1, 1 << 16)), dtype=np.uint8)
                       for _ in range(count)]
            targets = [np.zeros(source.size, dtype=np.uint8) for source in sources]
            await asyncio.wait_for(asyncio.gather(*(
                queue.copy(int(target.ctypes.data), int(source.ctypes.data), source.size, None,
                           (source, target))
                for source, target in zip(sources, targets, strict=True))), 10)
            for source, target in zip(sources, targets, strict=True):
                assert np.array_equal(source, target)
            if rng.random() < 0.3:
                await asyncio.sleep(0.002)  # let every worker fall asleep before the next turn
        assert queue.in_flight == 0
        assert queue.max_in_flight <= depth
    finally:
        await asyncio.wait_for(queue.close(), 10)  # a job no worker took would hang it
