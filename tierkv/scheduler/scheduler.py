"""The scheduler: per-tier eviction policies and the decisions made from them, as plans.

Pure and synchronous: no IO, time passed in. The engine reports what enters, is read in and
leaves each tier (`admitted`, `accessed`, `removed`) and asks what to do: which tier a put goes
to (`write_tier`), where write-through and `flush` make an object durable (`durable_tier`), where
a copy goes when it must leave a tier (`departures`, `expired`), whether an expiry's plan still
holds when it runs (`still_idle`), whether a hit in a lower tier earns a copy upward (`on_hit`),
and what keeping each copy is worth to a log reclaiming a region (`reclaim_worth`). It reads the
engine's index only through `Lookup`, which answers for one key at a time.

Two policies (`[scheduler] policy`): ``lru`` keeps each tier in least-recently-used order, admits
every demotion and promotes every hit below the first tier (the baseline); ``lru++`` ranks keys by
LRU++ score with the prefix rules (`tierkv.scheduler.lrupp`), admits demotions into persistent
tiers through an adaptive frequency filter (`tierkv.scheduler.admission`), and promotes a hit only
when its score outranks what the upper tier would give up for it and its next read is due before
the copy would leave that tier unread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Protocol

from tierkv.config import EvictionPolicy, SchedulerConfig
from tierkv.keys import is_engine_key
from tierkv.scheduler.admission import filters_for
from tierkv.scheduler.lineage import Lineage
from tierkv.scheduler.lru import LruPolicy
from tierkv.scheduler.lrupp import ScoredPolicy
from tierkv.scheduler.placement import (
    TierShape,
    demotion_target,
    first_persistent_for,
    first_tier_for,
)
from tierkv.scheduler.plans import Demote, Departure, Drop, Evict, Promote, Share, departs_from
from tierkv.scheduler.policy import EvictionPolicy as TierPolicy
from tierkv.scheduler.scores import ScoreBook
from tierkv.scheduler.select import TierProfile, select_tier


class Copies(Protocol):
    """What the scheduler reads of one indexed object."""

    @property
    def key(self) -> bytes: ...

    @property
    def generation(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def locations(self) -> Sequence[int]:
        """Tiers holding a copy, fastest first."""


#: the index seen by the scheduler: a key's object, or ``None``
Lookup = Callable[[bytes], Copies | None]


class Scheduler:
    def __init__(self, tiers: Sequence[TierShape], config: SchedulerConfig,
                 capacities: Sequence[int] | None = None, *, keep_lower_copies: bool = False,
                 ttls: Sequence[float | None] | None = None) -> None:
        self._tiers = tuple(tiers)
        self._config = config
        #: promotions move objects up (write-through engines keep every durable copy)
        self.exclusive = config.exclusive and not keep_lower_copies
        #: the tier other engines share (the last), if any: copies there never count as the
        #: lower copy that lets a local tier evict instead of demoting, and never move up
        self.shared: int | None = next(
            (index for index, tier in enumerate(self._tiers) if getattr(tier, "shared", False)),
            None)
        self.scored = config.policy is EvictionPolicy.LRUPP
        self.book = ScoreBook(config.alpha, config.beta)
        self.lineage = Lineage()
        self.policies: tuple[TierPolicy, ...]
        #: rank of the last key each tier admitted (`reclaim_worth`'s bar)
        self._newest_rank = [float("-inf")] * len(self._tiers)
        #: bit i set: a copy in tier i outlives a restart (a persistent tier, or the shared
        #: one, which the index does not count as volatile either)
        self._lasting = sum(1 << index for index, tier in enumerate(self._tiers)
                            if tier.persistent or index == self.shared)
        #: each tier's idle TTL (None: none), which bounds how long a copy stays there unread
        self._ttls = tuple(ttls) if ttls is not None else (None,) * len(self._tiers)
        self._scored: tuple[ScoredPolicy, ...] = ()
        if self.scored:
            # the recency order is kept only where a TTL asks for idle keys (`ttls` unknown: all)
            timed = ttls if ttls is not None else [0.0] * len(self._tiers)
            self._scored = tuple(ScoredPolicy(self.book, track_idle=ttl is not None)
                                 for ttl in timed)
            self.policies = self._scored
        else:
            self.policies = tuple(LruPolicy() for _ in self._tiers)
        #: False for a tier whose circuit breaker is open: no put or move is planned into it
        self.usable = [True] * len(self._tiers)
        #: each tier's access profile, set by the engine once measured (`select_tier`)
        self.profiles: tuple[TierProfile, ...] | None = None
        #: admission filters of the persistent tiers (index -> filter), `lru++` only
        self.admission = filters_for(self._tiers, capacities, config) if self.scored else {}

    # -- events ------------------------------------------------------------------------------
    def admitted(self, tier: int, key: bytes, now: float, parents: Sequence[bytes] = ()) -> None:
        if not self.scored:
            self.policies[tier].insert(key, now)
            return
        score, new = self.book.enter(key, tier, now)
        if new:
            adopted, score.depth, score.orphan = self.lineage.enter(
                key, parents[0] if parents else None)
            if adopted:
                self._rerank(adopted, orphan=False)
        self._scored[tier].insert_scored(key, score, now)
        self._newest_rank[tier] = self.book.rank(score)

    def accessed(self, tier: int, key: bytes, now: float) -> None:
        """`key` was read at `now` (served by `tier`): every tier's copy of it is as recent.
        Only the serving tier's, a copy below one that served every read aged there as if
        unread: its tier's ttl or evictor took it, and with it the object (a drop takes the
        copies above it) — the hottest object missed 50 of 60 reads, under `lru`."""
        if not self.scored:
            for policy in self.policies:  # a no-op where the policy does not hold it
                policy.touch(key, now)
            return
        score = self.book.access(key, now)
        if score is None:
            return
        held, index = score.tiers, 0  # inline, not `Score.held`: this is every get's path
        while held:
            if held & 1:
                self._scored[index].touch_scored(key, score, now)
            held >>= 1
            index += 1

    def looked_up(self, key: bytes, hit: bool) -> None:
        """A lookup of `key` by a get (`hit`: served); counted by the admission filters."""
        for admission in self.admission.values():
            admission.looked_up(key, hit)

    def removed(self, tier: int, key: bytes) -> None:
        self.policies[tier].remove(key)
        if self.scored and self.book.leave(key, tier):
            self._rerank(self.lineage.leave(key), orphan=True)

    def _rerank(self, keys: Sequence[bytes], *, orphan: bool) -> None:
        """Keys whose parent came (`orphan` False) or went: their standing in every tier holding
        them moved."""
        for key in keys:
            score = self.book.get(key)
            if score is None:
                continue
            score.orphan = orphan
            for index in score.held():
                self._scored[index].rerank(key)

    # -- placement ---------------------------------------------------------------------------
    def write_tier(self, nbytes: int, key: bytes = b"", now: float = 0.0,
                   latency_slo: float | None = None) -> int | None:
        """The tier a put goes to: without an SLO the fastest that can hold it at all (its
        score then decides where it lives, through eviction and promotion); with one,
        `select_tier` over the tiers' profiles at the key's access frequency."""
        if latency_slo is None or self.profiles is None:
            return first_tier_for(self._tiers, nbytes, 0, self.usable)
        room = [usable and tier.can_ever_hold(nbytes) and (tier.reclaims_space
                                                           or tier.fits(nbytes))
                for tier, usable in zip(self._tiers, self.usable, strict=True)]
        chosen = select_tier(self.profiles, nbytes, latency_slo,
                             self.book.frequency(key, now), room)
        return chosen if chosen is not None else first_tier_for(self._tiers, nbytes, 0,
                                                                self.usable)

    def next_tier(self, nbytes: int, after: int) -> int | None:
        """Where a write that the tier `after` could not take goes next."""
        return first_tier_for(self._tiers, nbytes, after + 1, self.usable)

    def durable_tier(self, nbytes: int, start: int = 0, *, any_breaker: bool = False
                     ) -> int | None:
        """Where write-through and `flush` make an object durable; with `any_breaker`, whatever
        the tiers' breakers say (a flush's last resort: `Guard.insist`)."""
        return first_persistent_for(self._tiers, nbytes, start,
                                    None if any_breaker else self.usable)

    def barrier_tier(self, nbytes: int) -> int | None:
        """Where `flush` writes what no persistent tier holds (and the engine's own records):
        the durable tier, or, when every one that could hold it has its breaker open, the first
        of those all the same: a barrier has nowhere else to go."""
        durable = self.durable_tier(nbytes)
        return self.durable_tier(nbytes, any_breaker=True) if durable is None else durable

    # -- moves -------------------------------------------------------------------------------
    def departures(self, tier: int, count: int, protected: Callable[[bytes], bool],
                   lookup: Lookup) -> list[Departure]:
        """Up to `count` plans that free space in `tier`, best victims first."""
        return list(self.departure_plans(tier, count, protected, lookup))

    def departure_plans(self, tier: int, count: int, protected: Callable[[bytes], bool],
                        lookup: Lookup) -> Iterator[Departure]:
        """`departures`, each plan made only when it is asked for: the victims are chosen
        together, but an evictor that needs the first two of sixteen pays for two plans (the
        other fourteen were 80 % of the planning of a spill into the pmem tier)."""
        for key in self.policies[tier].evict(count, protected):
            copies = lookup(key)
            if copies is not None and tier in copies.locations:
                yield self._depart(tier, copies)

    def expired(self, tier: int, cutoff: float, protected: Callable[[bytes], bool],
                lookup: Lookup, room: Callable[[int], int] | None = None) -> list[Departure]:
        """Plans moving what was idle in `tier` since before `cutoff` (its TTL) out of it.

        `room(t)`: footprint bytes tier t can take now without evicting anything. Given it,
        an idle object is only moved down into room that is free: a TTL frees the upper tier
        ahead of demand and makes objects durable sooner, but never pushes another object out
        of the cache (an expiry that demoted into a full tier dropped the lower tier's victims
        and left the upper tier empty, so the hierarchy held a fifth less than its capacity).
        Each plan carries `cutoff` (`idle_since`), for `still_idle` when it runs."""
        plans: list[Departure] = []
        free = {} if room is None else {t: room(t) for t in range(tier + 1, len(self._tiers))}
        for key in self.policies[tier].idle(cutoff):
            copies = lookup(key)
            if protected(key) or copies is None or tier not in copies.locations:
                continue
            decided: list[tuple[int, bool]] = []
            plan = self._depart(tier, copies, idle_since=cutoff, decided=decided)
            if room is not None and isinstance(plan, Demote):
                needs = self._tiers[plan.target].footprint(copies.nbytes)
                if free[plan.target] < needs:
                    continue  # nowhere to go without evicting another object: stay
                free[plan.target] -= needs
            for target, admitted in decided:  # counted for the plans made only
                self.admission[target].count(admitted)
            plans.append(plan)
        return plans

    def still_idle(self, plan: Departure) -> bool:
        """Whether `plan` may run now as far as idleness goes: an expiry's (`idle_since` set)
        only while its object has not been read or stored in its tier since the cutoff it was
        made for. Its executor asks when the plan comes to run, which the byte budget may put
        off long after `expired` made it: an object read meanwhile is hot again, and demoting
        it would send its next reads to a slower tier."""
        if plan.idle_since is None:
            return True  # the evictor's: the tier needs the room, idle or not
        return self.policies[departs_from(plan)].idle_since(plan.key, plan.idle_since)

    def _depart(self, tier: int, copies: Copies, *, idle_since: float | None = None,
                decided: list[tuple[int, bool]] | None = None) -> Departure:
        key, generation, nbytes = copies.key, copies.generation, copies.nbytes
        shared = self.shared
        if any(location > tier and location != shared for location in copies.locations):
            return Evict(key, generation, nbytes, tier, idle_since)
        target = demotion_target(self._tiers, tier, nbytes, self.usable)
        while target is not None and target != shared and not self._admits(target, key,
                                                                              decided):
            target = demotion_target(self._tiers, target, nbytes, self.usable)
        if target is not None and target == shared and shared in copies.locations:
            # the shared tier has it already: leaving the local tiers is all there is to do
            return Evict(key, generation, nbytes, tier, idle_since)
        if target is None:
            return Drop(key, generation, nbytes, tier, idle_since)
        return Demote(key, generation, nbytes, tier, target, idle_since)

    def _admits(self, tier: int, key: bytes, decided: list[tuple[int, bool]] | None) -> bool:
        if self.scored and (score := self.book.get(key)) is not None and score.orphan:
            return False  # no prefix lookup can reach it: not worth a write
        admission = self.admission.get(tier)
        if admission is None or decided is None:  # where no list is given, counted at once
            return admission is None or admission.admit(key)
        decided.append((tier, admission.admits(key)))
        return decided[-1][1]

    def reclaim_worth(self, tier: int, key: bytes, held: Collection[int]) -> float | None:
        """What copying `key`'s entry forward is worth to a tier that reclaims whole regions
        (the nvme log) when it reclaims the region holding it (a write), rather than dropping
        it; 0: drop it. The log copies the most valuable entries that leave it room.

        Under both policies, the engine's own records and the object's last lasting copy while
        a volatile tier holds it (`held`: the tiers holding it, as the index says) are worth
        the most (infinite: dropped, a `flush` or a write-through put was silently undone).
        LRU++: a copy of an object a faster tier holds is worth nothing (it is served from
        there, and comes back down as a demotion if it earns it), nor an orphan's; any other
        is worth how far its rank lies above that of the last object the tier admitted:
        copying forward what is worth no more than what arrives would push out better objects
        later (and with every rank equal, a stopped clock, the log would rewrite each region to
        free one entry). `lru`: None, the tier's own rule (no ranking to judge by)."""
        if is_engine_key(key):
            # the engine's own records (refused deletes, the fleet cursor): dropped, a flush
            # that recorded a delete is undone, and the deleted value comes back after a crash
            return math.inf
        if not self.scored:
            others = sum(1 << other for other in held if other != tier)
            return math.inf if others and not others & self._lasting else None
        score = self.book.get(key)
        if score is None:
            return 0.0
        bit = 1 << tier
        others = score.tiers & ~bit
        if others and not others & self._lasting:
            return math.inf
        if score.tiers & (bit - 1) or score.orphan:
            return 0.0
        return max(self.book.rank(score) - self._newest_rank[tier], 0.0)

    def on_hit(self, copies: Copies, served_from: int) -> Promote | None:
        """Whether a hit served from `served_from` earns a copy in the first tier. LRU: every
        hit below the first tier does, where the first tier can hold the object; LRU++: only
        when the first tier has room or its next victim ranks below the object."""
        top = 0
        if (not self._config.promote_on_hit or served_from <= top or top in copies.locations
                or not self.usable[top] or self._tiers[top].reclaims_space
                or not self._tiers[top].can_ever_hold(copies.nbytes)):
            return None
        if self.scored and not self._earns(top, copies.key, copies.nbytes):
            return None
        return Promote(copies.key, copies.generation, copies.nbytes, served_from, top,
                       self._moves_up(served_from))

    def _moves_up(self, source: int) -> bool:
        """Whether a promotion out of `source` deletes the source copy. Not out of a tier that
        reclaims space itself (the nvme log): deleting there frees nothing until its region is
        reclaimed, while the copy left in place saves a write if the object comes back down.
        Never out of the shared tier: other engines read it there."""
        return (self.exclusive and not self._tiers[source].reclaims_space
                and source != self.shared)

    def share(self, copies: Copies) -> Share | None:
        """The copy of a put into the shared tier (where there is one and it can hold it),
        from the fastest tier holding it."""
        shared, locations = self.shared, copies.locations
        if (shared is None or not locations or shared in locations or not self.usable[shared]
                or not self._tiers[shared].can_ever_hold(copies.nbytes)):
            return None
        return Share(copies.key, copies.generation, copies.nbytes, locations[0], shared)

    def warm(self, copies: Copies) -> Promote | None:
        """A prefetch of `copies` into the first tier, where it is held only below (no score
        test: the caller or the chain says it will be read soon)."""
        locations = copies.locations
        top = 0
        if (not locations or top in locations or not self.usable[top]
                or self._tiers[top].reclaims_space
                or not self._tiers[top].can_ever_hold(copies.nbytes)):
            return None
        return Promote(copies.key, copies.generation, copies.nbytes, locations[0], top,
                       self._moves_up(locations[0]))

    def following(self, key: bytes, depth: int, nbytes: int) -> list[bytes]:
        """Up to `depth` blocks after `key` (just read, of `nbytes`) in its chain, nearest
        first: at each step the best-ranked child (a prefix read of block i reads block i+1
        next). None where the next read of the chain is not due before a warmed copy of a
        block like `key` would leave the first tier (`_read_within`, at `key`'s interval)."""
        chain: list[bytes] = []
        if not self.scored or not self._read_within(0, key,
                                                    full=not self._tiers[0].fits(nbytes)):
            # the chain is read again about as often as `key` is: a warmed block would have
            # left the first tier before the next read reached it
            return chain
        book = self.book
        while len(chain) < depth:
            ranked = [(book.rank(score), child) for child in self.lineage.children(key)
                      if (score := book.get(child)) is not None]
            if not ranked:
                break
            key = max(ranked)[1]
            chain.append(key)
        return chain

    def _earns(self, tier: int, key: bytes, nbytes: int) -> bool:
        """Whether a copy of `key` in `tier` is worth its write: it outranks what the tier
        would give up for it (where the tier is full), and it is likely to be read there
        before the tier lets it go (`_read_within`)."""
        full = not self._tiers[tier].fits(nbytes)
        if full:
            lowest = self._scored[tier].lowest()
            if lowest is not None and self._scored[tier].standing(key) <= lowest:
                return False
        return self._read_within(tier, key, full=full)

    def _read_within(self, tier: int, key: bytes, *, full: bool) -> bool:
        """Whether `key`'s next read is due before a copy of it entering `tier` now would leave
        unread: its usual interval between reads (`Score.interval`) against the copy's expected
        stay. The stay is at most the tier's TTL; where the tier is `full`, it lasts until the
        ranks of what the tier lets go reach the key's, and those rise by `beta` a second (a
        rank is ``log(count) + beta * last``), so a copy ranked d above the next victim stays
        about d / beta seconds: the tier's characteristic time, as Che's approximation has it
        for LRU. A copy that leaves before its next read was a write for nothing, and while it
        stayed it took the room of another object (a promotion keeps the lower copy)."""
        score = self.book.get(key)
        if score is None:
            return True  # no reads seen to judge by
        ttl = self._ttls[tier]
        stay = math.inf if ttl is None else ttl
        beta = self.book.beta
        if full and beta > 0:
            lowest = self._scored[tier].lowest()
            standing = self._scored[tier].standing(key)
            if lowest is not None and standing[0] == lowest[0]:  # else orphans go first
                stay = min(stay, max(standing[1] - lowest[1], 0.0) / beta)
        return score.interval < stay
