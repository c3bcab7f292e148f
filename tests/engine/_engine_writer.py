"""Writer process for the engine crash tests (run as a script, not collected by pytest).

``python -m tests.engine._engine_writer DIR POLICY PMEM``: opens the engine on the hierarchy of
tests/engine/test_hierarchy.py under DIR and puts objects forever. With ``write_through`` it
prints ``ACK i`` after each put returns; with ``write_back`` it flushes every 7 puts and prints
``ACK i ...`` for the puts the flush covered. The parent kills it with SIGKILL.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import tierkv
from tests.engine.test_hierarchy import hierarchy


def value_of(i: int) -> bytes:
    return (b"%08d" % i) * (100 + (i * 37) % 700)


async def write(directory: Path, policy: str, with_pmem: bool) -> None:
    kv = await tierkv.open(hierarchy(directory, pmem=with_pmem, write_policy=policy))
    pending: list[int] = []
    for i in range(100_000):
        await kv.put(f"k{i}", value_of(i))
        if policy == "write_through":
            print("ACK", i, flush=True)
            continue
        pending.append(i)
        if len(pending) == 7:
            await kv.flush()
            print("ACK", *pending, flush=True)
            pending.clear()
    await kv.close()


if __name__ == "__main__":
    asyncio.run(write(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "pmem"))
