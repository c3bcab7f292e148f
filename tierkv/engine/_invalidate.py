"""Cascading, durable invalidation: removing a key's descendants, transitively, from every tier.

A write to an existing key, `invalidate(key)` and `invalidate_model(name)` remove everything
derived from the old value (`Dag.descendants`), one key at a time under that key's own gate (so
no two keys are ever held at once and no two invalidations can deadlock). Keys removed so far are
*doomed* until the invalidation returns: a put that names a doomed key as a parent while it runs
is taken as made just before it and invalidated in its own call (`put_while_doomed`: it stores
nothing and removes the key's old value and what derives from it), so a child put concurrently
with its parent's invalidation ends invalidated, never orphaned and live — also one the
invalidation had removed already and that was put again meanwhile. A put that linked a child
before its parent was doomed is found by the next pass; no put links one after, so a stream of
child puts never keeps an invalidation from ending (each pass found the children put during the
one before, and under a steady stream the passes never ended); `add_dependency` to a doomed
parent likewise invalidates the child and links nothing. Before returning, every
persistent tier is synced (group commit), so the deletes — tombstones in the nvme log, frees in the
pmem pool — are on media: no restart brings an invalidated object back. The last pass runs after
that sync, and the call returns in the same step when it finds nothing new. An overwriting put
whose old value had no descendants removes nothing and skips the sync (`barrier=False`): a sync
per overwrite cost a pmem-only engine's 1 MiB overwrites about a third of their bandwidth; the
explicit calls (`invalidate`, `invalidate_model`) always end with one.

With a shared tier, what an invalidation removed (and the key itself) is then deleted on the
server and published to the other engines (`_shared`); an invalidation another engine published
runs here `local`ly: local copies deleted, shared copies only forgotten, nothing published.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from tierkv._concurrency import outlive_cancel
from tierkv.engine._shared import Shared
from tierkv.engine._state import EngineState
from tierkv.engine._writes import Writes

#: keys a cascade removes between two turns of the event loop
YIELD_EVERY = 128


class Invalidations:
    __slots__ = ("_doomed", "_shared", "_st", "_writes")

    def __init__(self, state: EngineState, writes: Writes, shared: Shared) -> None:
        self._st = state
        self._writes = writes
        self._shared = shared
        #: the keys the running cascades remove, each counted once per cascade that dooms it
        self._doomed: Counter[bytes] = Counter()

    async def put_while_doomed(self, key: bytes, parents: Iterable[bytes]) -> bool:
        """Whether a running invalidation removes one of `parents` of a put of `key`: the put
        is then made during that invalidation and ends invalidated (see the module): nothing
        is stored, and `key`'s old value and what derives from it are removed, to the end
        whatever the caller (`invalidate`)."""
        if not await self.linked_while_doomed(key, parents):
            return False
        self._st.counters.puts += 1
        return True

    async def linked_while_doomed(self, key: bytes, parents: Iterable[bytes]) -> bool:
        """`put_while_doomed` for an edge (`add_dependency`): one to a doomed parent is made
        during the invalidation, so `key` ends invalidated and no edge is linked (a stream of
        relinks never keeps the invalidation from ending, as the module says of puts)."""
        doomed = self._doomed
        if not doomed or not any(parent in doomed for parent in parents):
            return False
        await self.invalidate(key)
        return True

    async def invalidate(self, key: bytes, *, local: bool = False,
                         order: int | None = None) -> int:
        """Remove `key` (if stored) and everything derived from it; how many objects went.
        `local`: another engine published it (see the module), in the fleet's entry of `order`
        (None: no entry). Runs to its end even if the caller is cancelled meanwhile: cut short,
        it would leave some of the objects removed and the fleet told of none (`overwritten`
        has the same reason)."""
        with self._dooming(key):
            return await outlive_cancel(self._invalidate(key, local, order))

    async def _invalidate(self, key: bytes, local: bool, order: int | None) -> int:
        with self._shared.invalidating() as hold:
            hold(key)
            return await self._descendants(key, local, True, hold, order, root=True)

    async def below(self, key: bytes) -> int:
        """Remove everything derived from `key`, a node that holds no value (a model version,
        `invalidate_model`), to its end whatever the caller (see `invalidate`); how many."""
        with self._dooming(key):
            return await outlive_cancel(self.descendants(key, barrier=True))

    @contextlib.contextmanager
    def _dooming(self, key: bytes) -> Iterator[None]:
        """`key` doomed for the caller's whole call, not only its cascade's: a put between the
        cascade's end and the caller's return (`outlive_cancel` resumes it a loop turn later)
        derived from `key` is put during the call."""
        self._doomed[key] += 1
        try:
            yield
        finally:
            self._release([key])

    def _release(self, keys: Iterable[bytes]) -> None:
        doomed = self._doomed
        for key in keys:
            doomed[key] -= 1
            if doomed[key] <= 0:
                del doomed[key]

    async def forget(self, key: bytes, order: int | None) -> int:
        """`invalidate(key, local=True)`: another engine invalidated `key`, in the fleet's
        entry of `order`."""
        return await self.invalidate(key, local=True, order=order)

    async def before_overwrite(self, key: bytes) -> frozenset[bytes]:
        """Before a put of `key` stores its new value: remove what derives from the old one,
        durably, telling no one yet (`overwritten` does, once the new value is in place). After
        the new value was written, a crash before its cascade had ended left it on media beside
        what derived from the old value (write-through: acknowledged or not, 2,000 of 2,000
        children readable again after a restart), and through a chain whose first link had gone
        no later write of `key` reached them. Runs to its end whatever the caller: cut short,
        the put is not made and the key keeps its old value, whose descendants are gone (misses,
        never stale). A key nothing derives from awaits nothing. Returns the keys removed or
        doomed, for `overwritten` to publish."""
        if not self._st.dag.has_children(key):
            return frozenset()
        with self._shared.invalidating() as hold:
            _, doomed = await outlive_cancel(self._cascade(key, False, False, hold))
        return frozenset(doomed - {key})

    async def overwritten(self, key: bytes, removed: frozenset[bytes] = frozenset()) -> None:
        """A put stored a new value of `key`: remove what derived from the old one since
        `before_overwrite` (a child put meanwhile) and tell the fleet of it all, `removed` (what
        `before_overwrite` removed) included (`descendants`, no barrier). Runs to its end even
        if the put's caller is cancelled meanwhile: the new value is in place, so neither what
        derived from the old one nor the fleet's copies of it may stay readable. The common
        overwrite (nothing derived from the old value, no fleet) awaits nothing."""
        if self._st.dag.has_children(key) or self._shared.publishes:
            await outlive_cancel(self.descendants(key, barrier=False, also=removed))

    async def descendants(self, key: bytes, *, local: bool = False, barrier: bool,
                          also: frozenset[bytes] = frozenset()) -> int:
        """Remove everything derived from `key` (not `key` itself), durably; how many.
        `barrier`: sync the persistent tiers even if nothing derives from `key`. `also`: keys
        removed before, published with these."""
        with self._shared.invalidating() as hold:
            return await self._descendants(key, local, barrier, hold, None, also=also)

    async def _descendants(self, key: bytes, local: bool, barrier: bool,
                           hold: Callable[[bytes], None], order: int | None, *,
                           root: bool = False, also: frozenset[bytes] = frozenset()) -> int:
        """`descendants` (and `key` itself: `root`), each key doomed held back from adoption
        (`Shared.invalidating`) until the fleet has been told. For another engine's entry of
        `order`: what derives from `key` here that the entry did not name is published too
        (the publisher did not know it derives from `key`, and other engines, this one
        included, would adopt its records from the server again), without waiting for the
        follower, which calls this."""
        removed, doomed = await self._cascade(key, local, barrier, hold, root=root)
        if not local:
            await self._shared.publish([key, *(k for k in doomed | also if k != key)])
        elif order is not None:
            unnamed = self._shared.unnamed((k for k in doomed if k != key), order)
            if unnamed:
                await self._shared.publish(unnamed, read_back=False)
        return removed

    async def _cascade(self, key: bytes, local: bool, barrier: bool,
                       hold: Callable[[bytes], None], *, root: bool = False
                       ) -> tuple[int, set[bytes]]:
        """Remove what derives from `key` (and `key` itself, last: `root`); how many objects
        went, and the keys doomed. Each pass removes the farthest first, `key` after its first
        pass: whatever a crash leaves of the doomed keys on media stays reachable from `key`
        through the edges their headers (and the departed-edges record) keep, so the next write
        or invalidation of `key` removes it. Removed nearest first, a crash after the first
        link of a chain left the rest of it where no write of `key` reached it any more."""
        doomed = {key}
        if not barrier and not root and not self._st.dag.has_children(key):
            return 0, doomed  # the common overwrite: nothing derives from the old value
        self._doomed[key] += 1
        try:
            removed = await self._passes(key, local, barrier, hold, root=root, doomed=doomed)
        finally:
            self._release(doomed)
        return removed, doomed

    async def _passes(self, key: bytes, local: bool, barrier: bool,
                      hold: Callable[[bytes], None], *, root: bool, doomed: set[bytes]
                      ) -> int:
        """`_cascade`'s passes, until one after the last sync finds nothing new; how many
        objects went. Each key found joins `doomed` (and the running cascades' count)."""
        st = self._st
        removed = 0
        synced = False
        while True:
            pending = self._new_descendants(key, doomed)
            if not pending and not root:
                if synced:
                    return removed
                await self._sync()
                synced = True
                continue
            synced = False
            self._doomed.update(child for child in pending if child not in doomed)
            doomed.update(pending)
            for child in pending:
                hold(child)
            # breadth-first order reversed: a key goes before the one that linked it into the
            # order, so a kept key's path from `key` is kept too
            for turn, child in enumerate(reversed(pending), 1):
                if await self._writes.delete(child, keep_shared=local):
                    removed += 1
                    st.counters.cascaded += 1
                st.index.unlink(child)  # a key never stored: no edges either
                if not turn % YIELD_EVERY:
                    # deletes from the pool and the first tier complete without suspending:
                    # 5,451 of them held the loop 136 ms, every other call waiting
                    await asyncio.sleep(0)
            if root:
                removed += await self._writes.delete(key, keep_shared=local)
                root = False

    def _new_descendants(self, root: bytes, doomed: set[bytes]) -> list[bytes]:
        """What derives from the doomed keys now, but `root`: each key removed so far was
        unlinked from its parents, so one found again was put again (linked anew) since, during
        the invalidation, and must go again (skipped as doomed, a child recomputed while its
        parent was being invalidated stayed readable)."""
        dag = self._st.dag
        found: list[bytes] = []
        seen: set[bytes] = {root}
        for key in doomed:
            for child in dag.descendants(key):
                if child not in seen:
                    seen.add(child)
                    found.append(child)
        return found

    async def _sync(self) -> None:
        st = self._st
        for index, tier in enumerate(st.tiers):
            if tier.persistent:
                await st.commits[index].sync()
