"""Offline cache baselines of a request trace: block-granular LRU and Belady's MIN.

Both take the trace as the hash ids of each request, in order, and a capacity in blocks, and
return the fraction of block references served from the cache. They are pure functions over the
whole trace at once (no engine, no IO, no clock), so the engine's replay can be set beside them.

- `lru_hit_ratio`: what an inference server with one LRU cache of blocks gets, *under prefix
  semantics*: block i of a request is served only if blocks 0..i-1 were (the KV of a block is
  useless without the KV of the prefix before it).
- `min_hit_ratio`: Belady's optimal replacement with bypass, with *no* prefix rule: every
  reference to a cached block counts. It sees the future and ignores the prefix rule, so no
  demand-fetching cache of that many blocks does better: an upper bound, not a target.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence


def lru_hit_ratio(requests: Sequence[Sequence[int]], capacity_blocks: int) -> float:
    """Hit ratio of a block LRU cache of `capacity_blocks` under prefix semantics.

    Per request: the hits are the leading run of its blocks found in the cache; then every block,
    in order 0..n-1, is touched (moved to most recently used) or inserted, evicting the least
    recently used beyond capacity after each insert. Blocks found behind a miss are touched like
    the others but are not hits.
    """
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    cache: OrderedDict[int, None] = OrderedDict()
    references = hits = 0
    for ids in requests:
        references += len(ids)
        for block in ids:
            if block not in cache:
                break
            hits += 1
        if not capacity_blocks:
            continue
        for block in ids:
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hits / references if references else 0.0


def min_hit_ratio(requests: Sequence[Sequence[int]], capacity_blocks: int) -> float:
    """Hit ratio of Belady's MIN (OPT with bypass) over every block reference, no prefix rule.

    References are taken in trace order. On a hit the block stays; on a miss a block never
    referenced again is not inserted, and with the cache full the cached block whose next use is
    farthest is evicted for the newcomer, unless the newcomer's own next use is farther still (then
    it is bypassed). Next uses are precomputed; the farthest is found with a max-heap whose stale
    entries (a block since referenced again, or evicted) are skipped when they surface.
    """
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    stream = [block for ids in requests for block in ids]
    never = len(stream)  # a next use past the end: never referenced again
    next_use = [never] * len(stream)
    seen: dict[int, int] = {}
    for position in range(len(stream) - 1, -1, -1):
        block = stream[position]
        next_use[position] = seen.get(block, never)
        seen[block] = position
    cached: dict[int, int] = {}  # block -> the position of its next use
    farthest: list[tuple[int, int]] = []  # (-next use, block), stale entries included
    hits = 0
    for position, block in enumerate(stream):
        upcoming = next_use[position]
        if block in cached:
            hits += 1
        elif upcoming == never or not capacity_blocks:
            continue  # bypass: nothing is gained by caching it
        elif len(cached) >= capacity_blocks:
            while -farthest[0][0] != cached.get(farthest[0][1]):
                heapq.heappop(farthest)
            if -farthest[0][0] <= upcoming:
                continue  # the newcomer is needed last: bypass it
            del cached[heapq.heappop(farthest)[1]]
        if upcoming == never:
            del cached[block]  # a hit on its last use: the slot is free from now on
            continue
        cached[block] = upcoming
        heapq.heappush(farthest, (-upcoming, block))
    return hits / len(stream) if stream else 0.0
