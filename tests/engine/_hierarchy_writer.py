"""Writer process for the hierarchy crash tests (run as a module, not collected by pytest).

``python -m tests.engine._hierarchy_writer DIR POLICY MODE PREFIX A B`` opens the engine on
`tests.engine._configs.crash_hierarchy` (gpu → pmem → nvme) under DIR and puts 64 KiB objects
under keys ``PREFIX<i>``; it reports on stdout, one line each, flushed at once:

- ``PUT i``: ``put`` of object i returned (under write_back that acknowledges nothing);
- ``ACK i j ...``: those objects are acknowledged: under write_through each put that returned,
  under write_back every put a returned ``flush()`` covered;
- ``DONE``: the writer is done and waits to be killed.

MODE ``fixed`` (A = N, B = EXTRA): N puts, then under write_back one ``flush()``; then EXTRA
more puts that no flush covers (under write_through each is acknowledged as usual); ``DONE``.
MODE ``loop`` (A = FLUSH_EVERY, B unused): puts forever; under write_back a ``flush()`` every
FLUSH_EVERY puts acknowledges them. The parent kills the writer with SIGKILL.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import tierkv
from tests.engine._configs import crash_hierarchy

OBJECT_SIZE = 64 << 10
#: after DONE the writer waits this long for its SIGKILL, then closes and exits
IDLE_LIMIT = 300.0


def value_of(prefix: str, i: int) -> bytes:
    """Object i of a run: 64 KiB naming its key, the rest seeded by it (distinct per key)."""
    head = f"{prefix}{i}|".encode().ljust(32, b".")
    return head + random.Random(f"{prefix}{i}").randbytes(OBJECT_SIZE - len(head))


def say(*words: object) -> None:
    print(*words, flush=True)


async def fixed(kv: tierkv.Engine, policy: str, prefix: str, count: int, extra: int) -> None:
    for i in range(count + extra):
        if i == count and policy == "write_back":
            await kv.flush()
            say("ACK", *range(count))
        await kv.put(f"{prefix}{i}", value_of(prefix, i))
        say("PUT", i)
        if policy == "write_through":
            say("ACK", i)
    if extra == 0 and policy == "write_back":
        await kv.flush()
        say("ACK", *range(count))


async def loop(kv: tierkv.Engine, policy: str, prefix: str, flush_every: int) -> None:
    pending: list[int] = []
    for i in range(1_000_000):
        await kv.put(f"{prefix}{i}", value_of(prefix, i))
        say("PUT", i)
        if policy == "write_through":
            say("ACK", i)
            continue
        pending.append(i)
        if len(pending) >= flush_every:
            await kv.flush()
            say("ACK", *pending)
            pending.clear()


async def main(argv: list[str]) -> None:
    directory, policy, mode, prefix = Path(argv[0]), argv[1], argv[2], argv[3]
    a, b = int(argv[4]), int(argv[5])
    kv = await tierkv.open(crash_hierarchy(directory, policy))
    try:
        if mode == "fixed":
            await fixed(kv, policy, prefix, a, b)
        elif mode == "loop":
            await loop(kv, policy, prefix, a)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        say("DONE")
        await asyncio.sleep(IDLE_LIMIT)
    finally:
        await kv.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
