"""Per-key ordering of the engine's operations, and the cleanup of what a cancelled one left.

`KeyGate.hold(key)` runs the operations on one key (put, delete, pin, each background move, each
copy `flush` makes) one at a time, in the order they asked; operations on different keys never
wait for each other. It is the only lock held across device IO, and it only ever blocks an
operation on the same key.

An operation marks a tier *dirty* for its key (`Claim.mark`) before an IO that may leave a copy
there which the index does not list (a write not yet committed, a delete not yet done), and
clears the mark once the index and the tier agree again. If it is cancelled or fails in
between, the mark stays, and the next holder of the key first *scrubs* it: deletes the key's
copy from each dirty tier unless the index lists that tier. A key left dirty with nobody
waiting is scrubbed by a janitor task. So a cancelled put or move never leaves an orphan copy
that nothing would ever evict, and never deletes a copy a later operation wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

#: deletes `key`'s copy from each tier of `dirty` that the index does not list, discarding each
#: tier from `dirty` once done; it raises nothing but `CancelledError` (a failing delete is
#: logged and forgotten: the copy then stays an orphan until the tier is reopened)
Scrub = Callable[[bytes, set[int]], Awaitable[None]]
#: starts a background task the engine keeps track of (and waits for at close)
Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]


@dataclass(slots=True, eq=False)
class Claim:
    """One key's slot: its lock, how many operations hold or wait for it, its dirty tiers."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    dirty: set[int] = field(default_factory=set)

    def mark(self, tier: int) -> None:
        self.dirty.add(tier)

    def clear(self, tier: int) -> None:
        self.dirty.discard(tier)


class KeyGate:
    def __init__(self, scrub: Scrub, spawn: Spawn) -> None:
        self._claims: dict[bytes, Claim] = {}
        self._scrub = scrub
        self._spawn = spawn

    def busy(self, key: bytes) -> bool:
        """Whether an operation holds or waits for `key` (or its cleanup is pending)."""
        return key in self._claims

    def __len__(self) -> int:
        return len(self._claims)

    @contextlib.asynccontextmanager
    async def hold(self, key: bytes) -> AsyncIterator[Claim]:
        """Hold `key` for one operation, after the operations that asked before; scrubs first."""
        claim = self._claims.get(key)
        if claim is None:
            claim = self._claims[key] = Claim()
        claim.users += 1
        try:
            async with claim.lock:
                if claim.dirty:
                    await self._scrub(key, claim.dirty)
                yield claim
        finally:
            claim.users -= 1
            if not claim.users:
                if claim.dirty:
                    # nobody else waits for the key: clean up in the background; the claim stays
                    # (the key counts as busy) so that whoever comes next scrubs first
                    self._spawn(self._janitor(key))
                else:
                    del self._claims[key]

    async def _janitor(self, key: bytes) -> None:
        async with self.hold(key):
            pass
