"""Background work of the NVMe tier and the ways its callers wait for it.

Region writes run as tasks the tier starts and owns (`LogState.sealing`, `Region.writes`). A
caller that waits for them may be cancelled at that wait; the work must go on regardless (its
buffer and the log's state depend on its outcome), so waits here never cancel what they wait
for, which `asyncio.gather` would do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Set
from typing import Any


def spawn(work: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]],
          done: Callable[[], None] | None = None) -> asyncio.Task[None]:
    """Run `work` as a task that stays in `tasks` until it is done; then `done()` is called
    (after the task left `tasks`, so whoever `done` wakes sees it gone)."""
    task = asyncio.create_task(work)
    tasks.add(task)

    def finished(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if done is not None:
            done()

    task.add_done_callback(finished)
    return task


async def settle(tasks: Set[asyncio.Task[None]]) -> None:
    """Wait until `tasks` (a live set that tasks leave when done, see `spawn`) is empty.

    A cancellation of the caller stops the wait only; the tasks go on.
    """
    while tasks:
        await asyncio.wait(set(tasks))


async def wait_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Wait until the tasks in `tasks` now are done (not those that join a live set later, as
    `settle` does: a flush waits for what it must cover, not for appends made after it).

    A cancellation of the caller stops the wait only; the tasks go on.
    """
    pending = {task for task in tasks if not task.done()}
    if pending:
        await asyncio.wait(pending)
