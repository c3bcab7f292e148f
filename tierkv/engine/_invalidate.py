"""Cascading, durable invalidation: removing a key's descendants, transitively, from every tier.

A write to an existing key, `invalidate(key)` and `invalidate_model(name)` remove everything
derived from the old value (`Dag.descendants`), one key at a time under that key's own gate (so
no two keys are ever held at once and no two invalidations can deadlock). Keys removed so far are
*doomed* until the invalidation returns: a put that names a doomed key as a parent while it runs
links to it like any other, and the next pass removes that child too, so a child put concurrently
with its parent's invalidation ends invalidated, never orphaned and live — also one the
invalidation had removed already and that was put again meanwhile. Before returning, every
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

from collections.abc import Callable

from tierkv._concurrency import outlive_cancel
from tierkv.engine._shared import Shared
from tierkv.engine._state import EngineState
from tierkv.engine._writes import Writes


class Invalidations:
    __slots__ = ("_shared", "_st", "_writes")

    def __init__(self, state: EngineState, writes: Writes, shared: Shared) -> None:
        self._st = state
        self._writes = writes
        self._shared = shared

    async def invalidate(self, key: bytes, *, local: bool = False,
                         order: int | None = None) -> int:
        """Remove `key` (if stored) and everything derived from it; how many objects went.
        `local`: another engine published it (see the module), in the fleet's entry of `order`
        (None: no entry). Runs to its end even if the caller is cancelled meanwhile: cut short,
        it would leave some of the objects removed and the fleet told of none (`overwritten`
        has the same reason)."""
        return await outlive_cancel(self._invalidate(key, local, order))

    async def _invalidate(self, key: bytes, local: bool, order: int | None) -> int:
        with self._shared.invalidating() as hold:
            hold(key)
            removed = int(await self._writes.delete(key, keep_shared=local))
            return removed + await self._descendants(key, local, True, hold, order)

    async def below(self, key: bytes) -> int:
        """Remove everything derived from `key`, a node that holds no value (a model version,
        `invalidate_model`), to its end whatever the caller (see `invalidate`); how many."""
        return await outlive_cancel(self.descendants(key, barrier=True))

    async def forget(self, key: bytes, order: int | None) -> int:
        """`invalidate(key, local=True)`: another engine invalidated `key`, in the fleet's
        entry of `order`."""
        return await self.invalidate(key, local=True, order=order)

    async def overwritten(self, key: bytes) -> None:
        """A put stored a new value of `key`: remove what derived from the old one and tell the
        fleet (`descendants`, no barrier). Runs to its end even if the put's caller is cancelled
        meanwhile: the new value is in place, so neither what derived from the old one nor the
        fleet's copies of it may stay readable. The common overwrite (nothing derived from the
        old value, no fleet) awaits nothing."""
        if self._st.dag.has_children(key) or self._shared.publishes:
            await outlive_cancel(self.descendants(key, barrier=False))

    async def descendants(self, key: bytes, *, local: bool = False, barrier: bool) -> int:
        """Remove everything derived from `key` (not `key` itself), durably; how many.
        `barrier`: sync the persistent tiers even if nothing derives from `key`."""
        with self._shared.invalidating() as hold:
            return await self._descendants(key, local, barrier, hold, None)

    async def _descendants(self, key: bytes, local: bool, barrier: bool,
                           hold: Callable[[bytes], None], order: int | None) -> int:
        """`descendants`, each key doomed held back from adoption (`Shared.invalidating`)
        until the fleet has been told. For another engine's entry of `order`: what derives
        from `key` here that the entry did not name is published too (the publisher did not
        know it derives from `key`, and other engines, this one included, would adopt its
        records from the server again), without waiting for the follower, which calls this."""
        removed, doomed = await self._cascade(key, local, barrier, hold)
        if not local:
            await self._shared.publish([key, *(k for k in doomed if k != key)])
        elif order is not None:
            unnamed = self._shared.unnamed((k for k in doomed if k != key), order)
            if unnamed:
                await self._shared.publish(unnamed, read_back=False)
        return removed

    async def _cascade(self, key: bytes, local: bool, barrier: bool,
                       hold: Callable[[bytes], None]) -> tuple[int, set[bytes]]:
        st = self._st
        doomed = {key}
        if not barrier and not st.dag.has_children(key):
            return 0, doomed  # the common overwrite: nothing derives from the old value
        removed = 0
        synced = False
        while True:
            pending = self._new_descendants(key, doomed)
            if not pending:
                if synced:
                    return removed, doomed
                await self._sync()
                synced = True
                continue
            synced = False
            for child in pending:
                doomed.add(child)
                hold(child)
                if await self._writes.delete(child, keep_shared=local):
                    removed += 1
                    st.counters.cascaded += 1
                st.index.unlink(child)  # a key never stored: no edges either

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
