"""The engine's side of the shared tier: lookups of local misses, adoption, sharing of puts,
and the fleet's invalidations in both directions.

Other engines write the shared tier, so the local index cannot list what it holds. A key the
index does not know is looked up there (`lookup`: one pipelined round trip per batch of a
`get_many`'s misses); a record found is *adopted*: indexed here with a local generation, its
parents linked in the DAG, and promoted per policy (a copy: the shared copy stays). A record is
refused (a miss) when it predates an invalidation of its key or of an ancestor it can be traced
to — through the records of the same lookup and this engine's DAG (`Fleet.stale`), or while
this engine invalidates one of them (`invalidating`): from before its local delete until the
entry's tomb is set, a record the lookup read before the server delete would otherwise be
adopted after the local delete, and stay (the engine skips its own entries in the log).

Every put is copied to the shared tier in the background (`share`, a `Share` plan): the next
engine that misses finds it there.

Invalidations: what this engine invalidates is deleted on the server and published in the
fleet's log (`publish`), whether this engine held it there or not; what another engine
publishes is dropped here — every local copy and everything derived from it locally, the
shared copies only forgotten (the publisher deleted what it invalidated; a record there now may
be newer). An engine whose unread entries were trimmed from the log drops everything it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

from tierkv.engine._commit import GroupCommit
from tierkv.engine._executor import MoveExecutor
from tierkv.engine._fleet_cursor import encode_cursor, saved_cursor
from tierkv.engine._own import keep_own, own_tiers, read_records
from tierkv.engine._state import EngineState
from tierkv.errors import DependencyCycleError, DeviceError, TierKVError, TierUnavailableError
from tierkv.formats.shared_record import SharedRecord
from tierkv.formats.tombstones import UNPUBLISHED_MAGIC, decode_tombstones, encode_tombstones
from tierkv.formats.value import ObjectMeta, Payload
from tierkv.keys import FLEET_CURSOR_KEY, UNPUBLISHED_KEY

if TYPE_CHECKING:
    from tierkv.tiers.redis import RedisTier
    from tierkv.tiers.redis._fleet import Fleet

log = logging.getLogger("tierkv.engine")
Found = tuple[ObjectMeta, Payload]
#: ancestors one staleness check follows at most (a chain of 64 Ki tokens in 16-token blocks)
MAX_ANCESTORS = 4096
#: invalidations kept while the server is unreachable, at most (the oldest go beyond)
MAX_UNPUBLISHED = 100_000
#: `Invalidations.forget`: drop a key another engine invalidated, by the entry of that order
#: (None: not for an entry, as when the log's history was lost)
Forget = Callable[[bytes, "int | None"], Awaitable[int]]


class Shared:
    __slots__ = ("_down", "_executor", "_forget", "_held_back", "_republishing", "_saving",
                 "_st", "_stamps", "_stopped", "_unpublished", "index", "tier")

    def __init__(self, state: EngineState, executor: MoveExecutor) -> None:
        self._st = state
        self._executor = executor
        self.index = state.scheduler.shared
        self.tier = (None if self.index is None
                     else cast("RedisTier", state.tiers[self.index]))
        self._forget: Forget | None = None
        #: the shared tier failed its last call: failures are counted, not logged, until it
        #: answers again
        self._down = False
        #: keys whose invalidation the server did not take (oldest first), each with the stamp
        #: of its latest keeping, published again once it answers (`tick`), and the task doing
        #: that; a key stays here, so in the record a flush saves, until the server took it
        self._unpublished: dict[bytes, int] = {}
        self._stamps = itertools.count()
        self._republishing: asyncio.Task[None] | None = None
        self._stopped = False
        #: one save of the fleet cursor at a time (`save_cursor`)
        self._saving = GroupCommit(self._save_cursor)
        #: keys this engine is invalidating, with how many invalidations hold each
        #: (`invalidating`): no record of them is adopted meanwhile
        self._held_back: Counter[bytes] = Counter()
        state.refused_shared_delete = self._refused_delete

    @contextlib.contextmanager
    def invalidating(self) -> Iterator[Callable[[bytes], None]]:
        """For one invalidation: a function that holds a key back, called before the key is
        deleted locally; no record of a key held back is adopted until the block ends (after
        `publish` set the tombs, or kept the keys to publish again)."""
        marked: set[bytes] = set()
        held = self._held_back

        def hold(key: bytes) -> None:
            if self.tier is not None and key not in marked:
                marked.add(key)
                held[key] += 1

        try:
            yield hold
        finally:
            for key in marked:
                held[key] -= 1
                if held[key] <= 0:
                    del held[key]

    async def start(self, forget: Forget) -> None:
        """Follow the fleet's log from now on; first apply to the objects recovered at open
        what the log invalidated since the cursor saved with them (`save_cursor`): the keys of
        entries after it held here, or that something held here derives from (a model version,
        a key deleted here: what a running engine's follower applies too), are invalidated here
        (one stored again since too: a miss, never a stale hit); if entries after it were
        trimmed, or no cursor was saved and some were, every recovered object is dropped. The
        position is saved at once, not first at a flush: a crash before one left what was put
        meanwhile with no position, and a log lost meanwhile unnoticed."""
        if self.tier is None or self.tier.fleet is None:
            return
        self._forget = forget
        self.tier.fleet.set_listeners(self._remote, self._history_lost)  # no entry slips by
        await self._load_unpublished()
        # not after removing anything: a delete a device refused is on media only once a flush
        # recorded it, and a crash before then must apply the entries again
        if not len(self._st.index) or not await self._catch_up(self.tier.fleet, forget):
            await self.save_cursor()

    async def _catch_up(self, fleet: Fleet, forget: Forget) -> bool:
        """The recovered objects brought up to the log; whether anything was removed."""
        saved = await saved_cursor(self._st)
        cursor, epoch = saved if saved is not None else (0, None)
        reaches = cursor >= fleet.horizon and await fleet.reaches(cursor, epoch)
        # the horizon again after the survey: the follower drops the tombs at or below a
        # horizon it learns meanwhile (`Fleet`), so past the cursor they are not all here
        if not reaches or cursor < fleet.horizon:
            log.warning("the shared tier's invalidation log no longer reaches back to when "
                        "this engine last ran: dropping the objects it recovered")
            self._st.counters.shared_recovered_dropped += len(self._st.index)
            await self._history_lost()
            return True
        since = cursor if saved is not None else -1
        index, dag = self._st.index, self._st.dag
        removed = 0
        for key, order in [(key, order) for key, order in fleet.tombs.items()
                           if order > since and (key in index or dag.has_children(key))]:
            removed += await forget(key, order)
        return removed > 0

    async def save_cursor(self) -> None:
        """Keep this engine's position in the fleet's log in the persistent tiers (two where
        there are two: `_own`), beside the objects it describes (`flush`, `close`): a restart
        applies what came after it. One save at a time (`GroupCommit`): a save asked for while
        another runs waits for it, then saves once more. Two side by side (two flushes) wrote
        the same records at once, and the earlier one's could land last: the invalidations
        kept unpublished since it began were lost at the next open."""
        if self.tier is None or self.tier.fleet is None or not own_tiers(self._st):
            return  # nothing persistent: nothing to recover, nothing to describe
        await self._saving.sync()

    async def _save_cursor(self) -> None:
        st = self._st
        fleet = None if self.tier is None else self.tier.fleet
        tiers = own_tiers(st)
        if fleet is None or not tiers:
            return
        unpublished = (encode_tombstones(dict.fromkeys(self._unpublished, 0), UNPUBLISHED_MAGIC)
                       if self._unpublished else None)
        try:
            kept = await keep_own(st, FLEET_CURSOR_KEY, encode_cursor(fleet.cursor, fleet.epoch),
                                  tiers)
            await keep_own(st, UNPUBLISHED_KEY, unpublished, kept)  # beside its cursor
            for tier in kept:
                await st.commits[tier].sync()
        except TierKVError as exc:  # the next open then starts from the log's start
            log.warning("could not keep the fleet cursor: %s", str(exc))

    async def _load_unpublished(self) -> None:
        """At open: the invalidations an earlier run kept unpublished (`save_cursor`), to be
        published once the server answers (`tick`)."""
        for keys in await read_records(
                self._st, UNPUBLISHED_KEY,
                lambda payload: decode_tombstones(payload, UNPUBLISHED_MAGIC),
                "the invalidations kept unpublished at the last close are unreadable"):
            self._keep_unpublished(list(keys))

    async def stop(self) -> None:
        """Stop following the fleet's log (close): no invalidation runs into closing tiers."""
        self._stopped = True  # and no kept invalidation is sent again (`tick`)
        if self.tier is not None and self.tier.fleet is not None:
            self.tier.fleet.set_listeners(None, None)
            await self.tier.fleet.stop()

    def _failed(self, what: str, exc: DeviceError) -> None:
        """Log the first failure of an outage (each is counted); `_reachable` ends it."""
        if isinstance(exc, TierUnavailableError):  # skipped: its breaker is open
            self._st.counters.breaker_skips += 1
            return
        self._st.counters.device_errors += 1
        if not self._down:
            self._down = True
            log.warning("the shared tier failed %s (further failures are not logged until it "
                        "answers again): %s", what, str(exc))

    def _reachable(self) -> None:
        if self._down:
            self._down = False
            log.warning("the shared tier answers again")

    # -- sharing -----------------------------------------------------------------------------
    def share(self, key: bytes) -> None:
        """Copy the object just put under `key` to the shared tier, in the background."""
        st = self._st
        entry = st.index.get(key)
        if self.tier is None or entry is None or entry.moving:
            return
        plan = st.scheduler.share(entry)
        if plan is not None:
            entry.moving = True
            self._executor.submit(plan, background=True)

    # -- lookups -----------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[bytes]) -> list[Found | None]:
        """The shared tier's objects for keys the index does not know, adopted; misses and
        refused records are ``None``."""
        st, tier, index = self._st, self.tier, self.index
        if tier is None or index is None or not keys:
            return [None] * len(keys)
        st.counters.shared_lookups += len(keys)
        with st.keys.watching(keys) as changed:
            try:
                records = await st.guards[index].read(tier.fetch_many, keys)
            except DeviceError as exc:
                self._failed("a lookup", exc)
                return [None] * len(keys)
            self._reachable()
            batch = {key: record for key, record in zip(keys, records, strict=True)
                     if record is not None}
            return [None if record is None else self._adopt(key, record, batch, changed)
                    for key, record in zip(keys, records, strict=True)]

    def _adopt(self, key: bytes, record: SharedRecord, batch: dict[bytes, SharedRecord],
               changed: Callable[[bytes], bool]) -> Found | None:
        """Index `record` as this engine's copy of `key` (no await: one step), unless an
        operation on `key` ran or runs since the lookup began (`changed`, `busy`): a delete
        that returned meanwhile removed what the server answered."""
        st, tier, index = self._st, self.tier, self.index
        assert tier is not None and tier.fleet is not None and index is not None
        traced = [key, *self._ancestors(record, batch)]
        unpublished, held_back = self._unpublished, self._held_back
        if tier.fleet.stale(record.stamp, traced) or any(
                k in held_back or k in unpublished for k in traced):
            # an invalidation or delete the server has not taken yet: the record may be the
            # value it removed (adopted, it stayed: its own entry, which the follower skips)
            st.counters.shared_stale += 1
            return None
        if key in st.index or st.keys.busy(key) or changed(key):
            # a put or delete of the key runs, or ran, here: its value wins
            st.counters.shared_busy += 1
            return None
        if tier.footprint(record.meta.nbytes) > tier.capacity - tier.used:
            # this engine's share of the server is full: the record is served, not held (held,
            # it would count above the share, and the engine's own puts could not be shared)
            st.counters.shared_unheld += 1
            st.counters.hits[st.names[index]] += 1
            st.read_bytes[index] += record.meta.nbytes
            return record.meta, record.payload
        try:
            st.index.set_parents(key, record.meta.parents)
        except DependencyCycleError:
            st.counters.dag_edges_refused += 1
            return None
        entry = st.index.new_entry(key, record.meta)
        tier.adopt(key, entry.generation, record)
        now = st.now()
        st.index.add_copy(entry, index, now)
        st.counters.shared_adopted += 1
        st.counters.hits[st.names[index]] += 1
        st.read_bytes[index] += entry.nbytes
        st.scheduler.accessed(index, key, now)
        plan = st.scheduler.on_hit(entry, index)
        if plan is not None:
            entry.moving = True
            self._executor.submit(plan, background=True)
        return entry.meta, record.payload

    def _ancestors(self, record: SharedRecord, batch: dict[bytes, SharedRecord]) -> list[bytes]:
        """The keys `record` derives from, as far as the lookup's records and the DAG know."""
        dag = self._st.dag
        seen: set[bytes] = set()
        pending = list(record.meta.parents)
        while pending and len(seen) < MAX_ANCESTORS:
            key = pending.pop()
            if key in seen:
                continue
            seen.add(key)
            found = batch.get(key)
            pending.extend(found.meta.parents if found is not None else dag.parents(key))
        return list(seen)

    # -- invalidations -----------------------------------------------------------------------
    @property
    def publishes(self) -> bool:
        """Whether `publish` tells a fleet anything (a shared tier with a fleet log)."""
        return self.tier is not None and self.index is not None and self.tier.fleet is not None

    async def publish(self, keys: Sequence[bytes], *, read_back: bool = True) -> None:
        """Delete `keys` on the server and tell the fleet they are invalid. An invalidation the
        server does not take (down, slow, its breaker open) is kept and published again once it
        answers (`tick`, every second), for as long as this engine runs; meanwhile it is local
        (logged once, counted). `read_back`: see `Fleet.publish` (False from the follower)."""
        if not await self._send(keys, read_back=read_back):
            self._keep_unpublished(keys)

    async def _send(self, keys: Sequence[bytes], *, read_back: bool = True) -> bool:
        """Delete `keys` on the server and publish them; whether the server took them (True
        where there is nothing to tell)."""
        tier, index = self.tier, self.index
        if tier is None or index is None or tier.fleet is None or not keys:
            return True
        try:
            guard = self._st.guards[index]
            await guard.settle(tier.delete_many, keys)
            await guard.settle(tier.fleet.publish, keys, read_back=read_back)
        except DeviceError as exc:
            self._failed("an invalidation (kept, to publish once it answers)", exc)
            return False
        return True

    def _refused_delete(self, key: bytes) -> None:
        """The server did not delete `key`'s object: kept as an unpublished invalidation
        (sent again once it answers, saved meanwhile, never adopted until then; left alone,
        the deleted value came back). Other engines then drop theirs too: misses, rarely."""
        self._st.counters.shared_deletes_refused += 1
        self._keep_unpublished([key])

    def _keep_unpublished(self, keys: Sequence[bytes]) -> None:
        unpublished = self._unpublished
        for key in keys:
            unpublished.pop(key, None)  # newest last
            unpublished[key] = next(self._stamps)
        excess = len(unpublished) - MAX_UNPUBLISHED
        if excess > 0:
            for key in list(itertools.islice(unpublished, excess)):
                del unpublished[key]
            self._st.counters.shared_unpublished_dropped += excess
            log.warning("the shared tier has been unreachable for %d invalidations: the %d "
                        "oldest will not be published", MAX_UNPUBLISHED + excess, excess)

    def tick(self) -> None:
        """Publish the kept invalidations again, in the background (the health watch calls it
        every second; one attempt at a time, none while the tier's breaker is open, none once
        the engine closes: what is kept then is saved for the next open, `save_cursor`)."""
        if (not self._unpublished or self.index is None or self._stopped
                or (self._republishing is not None and not self._republishing.done())
                or not self._st.scheduler.usable[self.index] or self._st.closing):
            return
        kept = dict(self._unpublished)
        self._st.counters.shared_republished += len(kept)
        self._republishing = self._st.spawn(self._republish(kept))

    async def _republish(self, kept: dict[bytes, int]) -> None:
        """Send the kept invalidations again; those the server took are no longer kept. Not
        before: taken out while the send was in flight, a flush meanwhile saved a record
        without them, and a crash then lost them (the next open never published them, and the
        fleet went on serving the invalidated values). One kept again since (a newer
        invalidation of the key the server did not take either) stays."""
        if await self._send(list(kept)):
            unpublished = self._unpublished
            for key, stamp in kept.items():
                if unpublished.get(key) == stamp:
                    del unpublished[key]

    async def _remote(self, keys: list[bytes], order: int) -> None:
        assert self._forget is not None
        for key in keys:
            self._st.counters.remote_invalidated += await self._forget(key, order)

    async def _history_lost(self, told: Sequence[bytes] = ()) -> None:
        """Drop what is held; `told`: invalidations the log may have lost, published again."""
        assert self._forget is not None
        # behind what this engine kept itself, which no other engine knows of, never past it
        self._keep_unpublished(told[max(0, len(told) - MAX_UNPUBLISHED + len(self._unpublished)):])
        for key in self._st.index.key_list():
            await self._forget(key, None)

    def unnamed(self, keys: Iterable[bytes], order: int) -> list[bytes]:
        """Of `keys`, derived here from a key the entry of `order` invalidated, those that no
        entry since invalidated: the publisher did not know they derive from it."""
        fleet = None if self.tier is None else self.tier.fleet
        if fleet is None:
            return []
        return [key for key in keys if not fleet.tombed_since(key, order)]
