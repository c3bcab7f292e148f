"""`flush` beside other tasks: a flush with nothing to do still lets them run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import tierkv
from tests.engine._configs import hierarchy_config

#: hierarchies where a flush found nothing to write without any await that suspends: no
#: persistent tier, or flushes of tiers with nothing written and no group commit
QUIET = [
    pytest.param(("gpu",), True, id="gpu"),
    pytest.param(("gpu", "pmem"), False, id="gpu-pmem-no-group-commit", marks=pytest.mark.pmem),
    pytest.param(("gpu", "nvme"), False, id="gpu-nvme-no-group-commit"),
    pytest.param(("gpu", "pmem", "nvme"), True, id="gpu-pmem-nvme", marks=pytest.mark.pmem),
]


@pytest.mark.parametrize(("kinds", "group_commit"), QUIET)
async def test_a_flush_with_nothing_to_do_lets_other_tasks_run(
        tmp_path: Path, kinds: tuple[str, ...], group_commit: bool) -> None:
    """A task flushing in a loop (a checkpointer) must not keep the loop to itself."""
    config = hierarchy_config(tmp_path, kinds)
    config["engine"]["group_commit"] = group_commit
    async with tierkv.open(config) as kv:
        await kv.put("k", b"v" * 100)
        await kv.flush()  # from here on there is nothing to write
        turns = 0
        stop = False

        async def other() -> None:
            nonlocal turns
            while not stop:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)  # the other task starts
        before = turns
        for _ in range(1000):
            await kv.flush()
        ran = turns - before
        stop = True
        await task
        assert ran >= 1000  # a turn of the loop per flush at least
        assert await kv.get("k") == b"v" * 100
