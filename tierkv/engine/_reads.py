"""Gets: lock-free reads of the fastest intact copy, and promotion on a hit below the top.

A get takes no lock. It reads the fastest copy its entry lists; if the entry was replaced or
removed while it read (a put, delete or invalidate of the key), it answers a miss, so a value
is never returned after the call that removed it has returned. If the copy it read moved away
meanwhile (a demotion committed, its source deleted) it tries the entry's next copy; if the tier
failed it tries the next copy; if the copy failed its checksum it is forgotten (counted) and the
next is tried. A hit served below the first tier asks the scheduler whether the object earns a
copy upward, which the executor then makes in the background.

Prefetch warms objects into the first tier through the same executor (and the background byte
budget): `prefetch` for keys a caller names, and after a get of a block of a known chain, the
next `prefetch_depth` blocks of that chain (the best-ranked child at each step), since a prefix
read of block i reads block i+1 next.

A key the index does not know is looked up in the shared tier, where there is one (`_shared`):
a get's alone, a `get_many`'s together, in one pipelined round trip per batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv._concurrency import bounded_map
from tierkv.engine._copies import CopyOps
from tierkv.engine._executor import MoveExecutor
from tierkv.engine._index import IndexEntry
from tierkv.engine._shared import Shared
from tierkv.engine._state import EngineState
from tierkv.errors import DeviceError
from tierkv.formats.value import ObjectMeta, Payload

Found = tuple[ObjectMeta, Payload]


class Reads:
    __slots__ = ("_copies", "_executor", "_fan_out", "_shared", "_st", "served")

    def __init__(self, state: EngineState, copies: CopyOps, executor: MoveExecutor,
                 shared: Shared) -> None:
        self._st = state
        self._copies = copies
        self._executor = executor
        self._shared = shared
        #: lower-tier reads one `get_many` keeps in flight: the deepest queue below the top
        self._fan_out = max((tier.queue_depth for tier in state.tiers[1:]),
                            default=state.tiers[0].queue_depth)
        #: the tier that served the `get` that returned last (None: it missed), for its
        #: caller to read as `get` returns, before its next await (latency, spans)
        self.served: int | None = None

    async def get(self, key: bytes) -> Found | None:
        st = self._st
        st.counters.gets += 1
        found = await self._local(key)  # a hit sets `served` as it returns
        if found is None:
            if self._shared.tier is not None and key not in st.index:
                found = (await self._shared.lookup([key]))[0]
            # set after the lookup's await, not before it: another get's hit meanwhile set it
            # too, and a miss was counted as that tier's hit (latency, span)
            self.served = None if found is None else self._shared.index
            if found is None:
                st.counters.misses += 1
        st.scheduler.looked_up(key, found is not None)
        return found

    async def _local(self, key: bytes) -> Found | None:
        """The fastest intact copy the index lists (see the module), or ``None``."""
        st = self._st
        entry = st.index.get(key)
        failed: list[int] = []
        # each turn reads one copy; copies moving away under the reads end it after a few
        for _turn in range(2 * len(st.tiers)):
            if entry is None:
                break
            tier = next((t for t in entry.locations if t not in failed), None)
            if tier is None:
                break
            try:
                got = await st.guards[tier].read(st.tiers[tier].get, key)
            except DeviceError as exc:
                st.device_failed(tier, "to read an object", exc)
                failed.append(tier)
                continue
            if st.index.get(key) is not entry:
                break  # replaced or removed while we read
            if got is not None and got[0].generation == entry.generation:
                st.counters.hits[st.names[tier]] += 1
                st.read_bytes[tier] += entry.nbytes
                st.scheduler.accessed(tier, key, st.now())
                if tier:
                    self._maybe_promote(entry, tier)
                self.served = tier
                return got
            if tier in entry.locations:
                self._copies.lost(entry, tier)
            # else the copy moved away while we read: try where it is now
        return None

    async def _held_shared(self, keys: Sequence[bytes]) -> list[Found | None]:
        """Reads of objects whose only copy is the shared tier's, together (`Tier.get_many`);
        a copy that changed or failed is forgotten, so the caller's lookup finds the current
        record."""
        st, tier = self._st, self._shared.index
        assert tier is not None
        entries = [st.index.get(key) for key in keys]
        try:
            got = await st.guards[tier].read(st.tiers[tier].get_many, keys)
        except DeviceError as exc:
            st.device_failed(tier, "to read objects", exc)
            return [None] * len(keys)
        results: list[Found | None] = []
        for key, entry, found in zip(keys, entries, got, strict=True):
            if entry is None or st.index.get(key) is not entry:
                results.append(None)
            elif found is not None and found[0].generation == entry.generation:
                st.counters.hits[st.names[tier]] += 1
                st.read_bytes[tier] += entry.nbytes
                st.scheduler.accessed(tier, key, st.now())
                self._maybe_promote(entry, tier)
                results.append(found)
            else:
                if tier in entry.locations:
                    self._copies.lost(entry, tier)
                results.append(None)
        return results

    def _maybe_promote(self, entry: IndexEntry, tier: int) -> None:
        st = self._st
        if entry.moving or st.keys.busy(entry.key):
            return
        plan = st.scheduler.on_hit(entry, tier)
        if plan is not None:
            entry.moving = True
            self._executor.submit(plan, background=True)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Warm `keys` into the first tier in the background; how many moves were started."""
        st = self._st
        started = 0
        for key in keys:
            entry = st.index.get(key)
            if entry is None or entry.moving or st.keys.busy(key):
                continue
            plan = st.scheduler.warm(entry)
            if plan is not None:
                # a prefetch is a read foretold: ranked as one, so the warmed object is not the
                # first tier's next victim the moment it arrives
                st.scheduler.accessed(plan.source, key, st.now())
                entry.moving = True
                st.counters.prefetches += 1
                self._executor.submit(plan, background=True)
                started += 1
        return started

    def _follow_chain(self, key: bytes, skip: Sequence[bytes] = ()) -> None:
        depth = self._st.config.scheduler.prefetch_depth
        entry = self._st.index.get(key)
        if depth and entry is not None:
            following = self._st.scheduler.following(key, depth, entry.nbytes)
            if following:
                self.prefetch([k for k in following if k not in skip])

    async def get_many(self, keys: Sequence[bytes]) -> list[Found | None]:
        """`get` of every key, in order: first-tier hits inline, the rest with at most the lower
        tiers' queue depth in flight. The blocks of a chain after the last one of the leading
        run of hits are prefetched."""
        st = self._st
        results: list[Found | None] = [None] * len(keys)
        slow: list[int] = []
        for position, key in enumerate(keys):
            entry = st.index.get(key)
            if entry is not None and entry.locations and entry.locations[0] == 0:
                results[position] = await self.get(key)
            else:
                slow.append(position)
        st.counters.gets += len(slow)
        shared = self._shared.index
        remote = [p for p in slow if shared is not None
                  and (entry := st.index.get(keys[p])) is not None and entry.locations == [shared]]
        if remote:  # held only by the shared tier: one pipelined round trip per batch
            for position, value in zip(remote, await self._held_shared([keys[p] for p in remote]),
                                       strict=True):
                results[position] = value
            held_shared = set(remote)
            local = [p for p in slow if p not in held_shared]
        else:
            local = slow
        found = await bounded_map(self._local, [keys[p] for p in local], self._fan_out)
        for position, value in zip(local, found, strict=True):
            results[position] = value
        if self._shared.tier is not None:
            unknown = [p for p in slow if results[p] is None and keys[p] not in st.index]
            adopted = await self._shared.lookup([keys[p] for p in unknown])
            for position, value in zip(unknown, adopted, strict=True):
                results[position] = value
        for position in slow:
            hit = results[position] is not None
            st.counters.misses += not hit
            st.scheduler.looked_up(keys[position], hit)
        run = next((i for i, got in enumerate(results) if got is None), len(results))
        if run:
            self._follow_chain(keys[run - 1], keys)
        return results
