"""Which region the NVMe log reclaims, and which of its entries are copied forward.

Apart from `_log` because it is the log's policy input: the victim (the configured eviction
order, or the emptiest region of a mostly free log), the owner's worth of each entry
(`Tier.set_reclaim_worth`: the engine's scheduler) or, without an owner, the tier's own rule
(`reinsert_hits`), and the room rule that makes every reclaim free what it was for. No await:
the log calls it before its reads and again after them (see `RegionLog._free_victim`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierkv.config import RegionEviction
from tierkv.formats.nvme_layout import entry_size
from tierkv.formats.value import ObjectMeta
from tierkv.tiers.nvme._regions import Region
from tierkv.tiers.nvme._state import LogState


@dataclass(frozen=True, slots=True)
class HotEntry:
    """An entry of a reclaimed region read back to be copied into the new head."""

    key: bytes
    meta: ObjectMeta
    header: bytes
    payload: bytes


def choose_victim(st: LogState, victims: list[Region]) -> Region:
    """The region of `victims` to reclaim: by the configured eviction order, unless the log is
    `mostly_free` and copies entries forward (`reinsert_hits` not 0, as `entries_to_keep`
    says). Then nothing is evicted for its age, only moved, and the region with the fewest
    live bytes makes the room with the least copying: the oldest region, full of live
    entries, kept only what left a large put its room and dropped the rest (10 of 15 cold
    objects of a log a third full, for one put of 700 KB). Without copying forward every
    reclaim drops its victim whole, and the configured order says which."""
    if st.config.reinsert_hits and mostly_free(st):
        return min(victims, key=lambda r: (r.live, r.seq))
    if st.config.eviction is RegionEviction.LRU:
        return min(victims, key=lambda r: (r.last_access, r.seq))
    return min(victims, key=lambda r: r.seq)


def entries_to_keep(st: LogState, victim: Region, room: int, asked: set[bytes],
                    taken: list[HotEntry]) -> list[bytes]:
    """The entries of `victim` to copy forward besides those `asked` for already (read into
    `taken`): those the owner says are worth it, else those read at least `reinsert_hits`
    times (where it is 0, only those the owner must not lose: worth infinitely much), the most
    valuable (most read) first, as long as they leave
    `room` bytes of the new head free, so that a reclaim always makes the room it was for
    (an owner that valued every entry would otherwise have the log rewrite region after
    region without freeing a byte). While at most half the log holds live entries, every
    entry is copied forward, the valued first (`mostly_free`)."""
    threshold = st.config.reinsert_hits
    worth = st.reclaim_worth
    if not threshold and worth is None:
        return []
    ample = bool(threshold) and mostly_free(st)
    # the head pads what is copied forward to a block boundary (`RegionLog._open_head`), and
    # `room` must be free after the padding: the budget ends a block before the last boundary
    # that leaves it. Without the padding counted the kept entries overflowed into the room by
    # up to a block, the put rotated again, the same entries went back and forth between two
    # regions, and the put never ended (a healthy log's puts were cut off as a slow device)
    budget = (st.config.region_size - room) // st.align * st.align - st.align
    budget -= sum(entry_size(len(e.header), len(e.payload), st.grain) for e in taken)
    candidates: list[tuple[float, bytes, int]] = []
    for key in st.index.keys_in_region(victim.index):
        loc = st.index.get(key)
        if key in asked or loc is None:
            continue
        value = worth(key) if worth is not None else None
        if value is None:
            value = loc.hits - threshold + 1 if threshold else 0
        elif not threshold and value != math.inf:
            continue  # copying forward is off: only what the owner must not lose
        if value > 0 or ample:
            candidates.append((value, key, loc.length))
    candidates.sort(key=lambda candidate: -candidate[0])  # stable: ties in index order
    chosen = []
    for _value, key, length in candidates:
        if length <= budget:
            budget -= length
            chosen.append(key)
    return chosen


def mostly_free(st: LogState) -> bool:
    """Whether the live entries fill at most half the log. A FIFO log reclaims its oldest
    region whether the log is full or not: each restart started a new head region (the last
    session's was sealed in place at close), and with few writes per session the log wrapped
    round and dropped every cold object while nearly empty (60 of 60 acknowledged objects gone
    after 13 restarts with 3 MB of a 15 MB log live). The cache drops only for room: copied
    forward, a reclaim of a mostly free log costs a write of what is live in one region, and
    the log then reclaims the region with the fewest live bytes (`choose_victim`)."""
    return st.live * 2 <= st.region_count * st.config.region_size
