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
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
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
    def __init__(self, scrub: Scrub, spawn: Spawn, released: Callable[[], None]) -> None:
        self._claims: dict[bytes, Claim] = {}
        self._scrub = scrub
        self._spawn = spawn
        #: called whenever a key is let go of: its copies may be evictable again
        self._released = released
        #: janitors not yet done: copies they will delete take space no evictor can free
        self.cleaning = 0
        #: keys `watching` watches: [watchers, operations that asked for the key meanwhile]
        self._watched: dict[bytes, list[int]] = {}

    def busy(self, key: bytes) -> bool:
        """Whether an operation holds or waits for `key` (or its cleanup is pending)."""
        return key in self._claims

    def busy_keys(self) -> list[bytes]:
        """The keys held or waited for now (few: one per operation in progress)."""
        return list(self._claims)

    def hold(self, key: bytes) -> _Hold:
        """``async with gate.hold(key) as claim``: hold `key` for one operation, after the
        operations that asked before; the key's dirty tiers are scrubbed first."""
        return _Hold(self, key)

    @contextlib.contextmanager
    def watching(self, keys: Sequence[bytes]) -> Iterator[Callable[[bytes], bool]]:
        """For a read that awaits something about `keys` without holding them (a lookup on the
        shared tier): a function that says whether an operation on the key ran since the watch
        began (or was running as it began). `busy` sees only the operations still running: a
        delete that began and ended while the read awaited went unseen, and the read adopted
        the value it had deleted (after the delete returned). Each watch compares against the
        key's count of operations at its own start: overlapping watches sharing one flag kept
        refusing, for as long as tight loops of gets kept one in flight, a key deleted once."""
        watched = self._watched
        started: dict[bytes, int] = {}
        for key in keys:
            watch = watched.setdefault(key, [0, 0])
            watch[0] += 1
            # one running now may end before the read does: as if it came after the start
            started[key] = watch[1] - (key in self._claims)

        def changed(key: bytes) -> bool:
            return watched[key][1] != started[key]

        try:
            yield changed
        finally:
            for key in keys:
                watch = watched[key]
                watch[0] -= 1
                if not watch[0]:
                    del watched[key]

    def _enter(self, key: bytes) -> Claim:
        watch = self._watched.get(key)
        if watch is not None:
            watch[1] += 1
        claim = self._claims.get(key)
        if claim is None:
            claim = self._claims[key] = Claim()
        claim.users += 1
        return claim

    def _leave(self, key: bytes, claim: Claim) -> None:
        claim.users -= 1
        if not claim.users:
            if claim.dirty:
                # nobody else waits for the key: clean up in the background; the claim stays
                # (the key counts as busy) so that whoever comes next scrubs first
                self.cleaning += 1
                self._spawn(self._janitor(key))
            else:
                del self._claims[key]
                self._released()

    async def _janitor(self, key: bytes) -> None:
        try:
            async with self.hold(key):
                pass
        finally:
            self.cleaning -= 1


class _Hold:
    """The async context of `KeyGate.hold`: the key's lock entered and left through the lock's
    own context protocol, by the same task (a class rather than a generator: every put, delete
    and move enters one)."""

    __slots__ = ("_claim", "_gate", "_key", "_locked")

    def __init__(self, gate: KeyGate, key: bytes) -> None:
        self._gate = gate
        self._key = key
        self._claim: Claim | None = None
        self._locked = False

    async def __aenter__(self) -> Claim:
        gate, key = self._gate, self._key
        claim = self._claim = gate._enter(key)
        try:
            await claim.lock.__aenter__()
            self._locked = True
            if claim.dirty:
                await gate._scrub(key, claim.dirty)
        except BaseException:
            await self._exit(None, None, None)
            raise
        return claim

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, traceback: TracebackType | None) -> None:
        await self._exit(exc_type, exc, traceback)

    async def _exit(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                    traceback: TracebackType | None) -> None:
        claim = self._claim
        assert claim is not None
        self._claim = None
        try:
            if self._locked:
                self._locked = False
                await claim.lock.__aexit__(exc_type, exc, traceback)
        finally:
            self._gate._leave(self._key, claim)
