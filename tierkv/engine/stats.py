"""Engine counters, reported by `Engine.stats()`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineCounters:
    puts: int = 0
    gets: int = 0
    misses: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    #: copies that left a tier to make room or because they idled (by the tier they left)
    evictions: Counter[str] = field(default_factory=Counter)
    #: copies moved down into a tier / up into a tier (by the tier they went to)
    demotions: Counter[str] = field(default_factory=Counter)
    promotions: Counter[str] = field(default_factory=Counter)
    #: objects that left the cache: dropped by the last tier that held them
    drops: int = 0
    #: moves into the first tier started by `prefetch` or by following a chain
    prefetches: int = 0
    expired: int = 0
    corrupt_reads: int = 0
    device_errors: int = 0
    invalidations: int = 0
    #: objects removed because something they derive from was overwritten or invalidated
    cascaded: int = 0
    #: edges named by recovered headers that would have closed a cycle (damage): not restored
    dag_edges_refused: int = 0
    #: `add_dependency` edges whose child's header could not be rewritten (the persistent
    #: copies without the edge were removed)
    dag_edges_unpersisted: int = 0
    #: flushes that could not record the edges into keys whose objects left (`_departed`)
    departed_edges_unrecorded: int = 0
    #: at open: intact objects each persistent tier recovered (its own stats count what it
    #: dropped as corrupt and the tombstones it applied), older copies of a key deleted, and
    #: the seconds opening and indexing took
    recovered: Counter[str] = field(default_factory=Counter)
    recovered_superseded: int = 0
    recovery_s: float = 0.0
    #: background moves that failed (their source copy stays) or were discarded (the object
    #: changed or was busy when the move came to run)
    moves_failed: int = 0
    moves_discarded: int = 0
    #: bytes copied by background moves
    moved_bytes: int = 0
    #: payload bytes moved down into / copied up into each tier, and every payload byte stored
    #: into each tier (by puts, flushes and moves alike), by tier name
    demoted_bytes: Counter[str] = field(default_factory=Counter)
    promoted_bytes: Counter[str] = field(default_factory=Counter)
    written_bytes: Counter[str] = field(default_factory=Counter)
    #: writes that waited for space in a full tier (backpressure), and the ones that gave up
    space_waits: int = 0
    space_timeouts: int = 0
    #: public calls that ended cancelled (a caller's timeout or cancellation): each left the
    #: key as the call's contract says, and a steady rate tells callers give up on the engine
    cancelled_calls: int = 0
    #: copies of cancelled or failed operations deleted afterwards
    orphans_scrubbed: int = 0
    #: copies a persistent tier failed to delete (each kept as a tombstone until deleted);
    #: those deleted on a later try; objects a tombstone removed at open
    deletes_refused: int = 0
    deletes_retried: int = 0
    recovered_tombstoned: int = 0
    #: the shared tier: puts copied there (objects, bytes); local misses looked up there, the
    #: ones found and adopted, the ones refused as stale (an invalidation they predate) or
    #: because the key was busy; keys other engines invalidated that this one dropped
    shared: Counter[str] = field(default_factory=Counter)
    shared_bytes: Counter[str] = field(default_factory=Counter)
    shared_lookups: int = 0
    shared_adopted: int = 0
    shared_stale: int = 0
    shared_busy: int = 0
    #: records found and served but not held: this engine's share of the server was full
    shared_unheld: int = 0
    #: shared copies found gone when read: evicted by the server or replaced by another
    #: engine (its own stats count the ones that failed their checksum)
    shared_lost: int = 0
    remote_invalidated: int = 0
    #: keys of kept invalidations sent again once the server answered (a failed try keeps
    #: them for the next), and those dropped because too many were kept while it was down
    shared_republished: int = 0
    shared_unpublished_dropped: int = 0
    #: deletes of this engine's the server did not take, kept to publish (`_shared`)
    shared_deletes_refused: int = 0
    #: circuit breakers: state changes ("tier:state" → count), and calls not made into a tier
    #: whose breaker was open (the caller read elsewhere or wrote to the next tier)
    breaker_transitions: Counter[str] = field(default_factory=Counter)
    breaker_skips: int = 0
    #: objects recovered at open and dropped because the fleet's log no longer reached back
    #: to this engine's saved cursor
    shared_recovered_dropped: int = 0

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            data[name] = dict(value) if isinstance(value, Counter) else value
        return data
