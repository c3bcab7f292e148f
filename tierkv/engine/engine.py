"""The engine: the public async API, the index (key → tiers), pins, and the moves between tiers.

Ownership. The engine is the only owner of "where is key K": `_index` maps each canonical key to an
`IndexEntry` listing the tiers that hold a valid copy. Tiers store bytes; the scheduler decides.

Concurrency. Everything runs on one event loop. Mutations of placement (put, delete, invalidate,
eviction, demotion, expiry, pin promotion) run one at a time under `_lock`, so the index never sees
two of them interleave. Gets take no lock: they read a copy while counting themselves as readers of
the entry, and a mutation removes a copy from a tier only after the entry's readers have drained.
A get whose entry was replaced or invalidated while it read answers a miss, so a value is never
returned after the `invalidate` (or overwriting `put`) that removed it has returned.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from tierkv.config import Config, GpuTierConfig, WritePolicy
from tierkv.engine.index import IndexEntry
from tierkv.engine.pins import PinContext
from tierkv.engine.stats import EngineCounters
from tierkv.errors import (
    DeviceError,
    EngineClosedError,
    ObjectNotFound,
    TierFullError,
    TierKVError,
)
from tierkv.formats.value import ObjectMeta, Payload, Value, decode_value, encode_value
from tierkv.keys import Key, encode_key
from tierkv.scheduler import LruPolicy, demotion_target, first_tier_for
from tierkv.tiers.base import PinToken, RecoveredObject, Tier, ZeroCopyPinning

log = logging.getLogger(__name__)
KeyT = TypeVar("KeyT", bound=Key)
ValueT = TypeVar("ValueT", bound=Value)


class Engine:
    """A tiered object store; build it with `tierkv.open(config)`."""

    def __init__(self, config: Config, tiers: Sequence[Tier]) -> None:
        self.config = config
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self._index: dict[bytes, IndexEntry] = {}
        # objects no persistent tier holds yet: what `flush` must write down
        self._volatile: dict[bytes, IndexEntry] = {}
        self._lru = [LruPolicy() for _ in self.tiers]
        self._pins: dict[bytes, int] = {}
        self._lock = asyncio.Lock()
        self._counters = EngineCounters()
        self._generation = 0
        self._closed = False
        self._expiry: asyncio.Task[None] | None = None
        first = config.tiers[0]
        self.device = (
            getattr(self.tiers[0], "device", torch.device("cpu"))
            if isinstance(first, GpuTierConfig)
            else torch.device("cpu")
        )

    # -- lifecycle -------------------------------------------------------------------------------
    async def _start(self) -> None:
        """Open every tier, rebuild the index from what the persistent ones recovered."""
        opened: list[Tier] = []
        try:
            for index, tier in enumerate(self.tiers):
                recovered = await tier.open()
                opened.append(tier)
                await self._adopt(index, recovered)
        except BaseException:
            for tier in reversed(opened):
                await tier.close()
            self._closed = True
            raise
        first = self.config.tiers[0]
        if isinstance(first, GpuTierConfig):
            self._expiry = asyncio.create_task(self._expire_loop(first.ttl))

    async def _adopt(self, tier_index: int, recovered: list[RecoveredObject]) -> None:
        """Index the objects a tier recovered; of two copies of a key the newest generation wins."""
        now = time.monotonic()
        tier = self.tiers[tier_index]
        for obj in recovered:
            entry = self._index.get(obj.key)
            if entry is not None and entry.generation > obj.meta.generation:
                await tier.delete(obj.key)
                continue
            if entry is not None and entry.generation == obj.meta.generation:
                entry.add_location(tier_index)
            else:
                if entry is not None:
                    await self._discard(obj.key, entry)
                self._index[obj.key] = IndexEntry(obj.meta, [tier_index])
            self._lru[tier_index].insert(obj.key, now)
            self._generation = max(self._generation, obj.meta.generation)

    async def close(self) -> None:
        """Flush to the persistent tiers (so a restart finds the cache), then close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        try:
            async with self._lock:
                await self._flush_locked()
        finally:
            for tier in self.tiers:
                await tier.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn("a tierkv engine was never closed", ResourceWarning, stacklevel=1)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")

    # -- reads -----------------------------------------------------------------------------------
    async def get(self, key: Key) -> bytes | torch.Tensor | None:
        """The value stored under `key`, or ``None`` on a miss.

        Bytes-like values come back as `bytes`; tensors with their dtype and shape, on the engine's
        device (the gpu tier's device, else the CPU). A copy that fails its checksum or whose
        device fails is a miss, never wrong bytes.
        """
        self._check_open()
        return await self._get_raw(encode_key(key))

    async def _get_raw(self, raw: bytes) -> bytes | torch.Tensor | None:
        self._counters.gets += 1
        found = await self._read(raw)
        if found is None:
            self._counters.misses += 1
            return None
        return self._decode(*found)

    async def get_many(self, keys: Sequence[Key]) -> list[bytes | torch.Tensor | None]:
        """`get` of every key, results in order; lower-tier reads run concurrently."""
        self._check_open()
        results: list[bytes | torch.Tensor | None] = [None] * len(keys)
        slow: list[tuple[int, bytes]] = []
        for position, raw in enumerate(map(encode_key, keys)):
            entry = self._index.get(raw)
            if entry is not None and entry.locations and entry.locations[0] == 0:
                results[position] = await self._get_raw(raw)
            else:
                slow.append((position, raw))
        values = await asyncio.gather(*(self._get_raw(raw) for _, raw in slow))
        for (position, _), value in zip(slow, values, strict=True):
            results[position] = value
        return results

    async def contains(self, key: Key) -> bool:
        self._check_open()
        return encode_key(key) in self._index

    async def locate(self, key: Key) -> str | None:
        """Name of the fastest tier holding `key`, or ``None``."""
        self._check_open()
        entry = self._index.get(encode_key(key))
        if entry is None or not entry.locations:
            return None
        return self.tiers[entry.locations[0]].name

    async def _read(self, raw: bytes) -> tuple[ObjectMeta, Payload] | None:
        """The fastest intact copy of `raw`, trying slower copies when a tier fails or lost it."""
        entry = self._index.get(raw)
        if entry is None:
            return None
        for tier_index in list(entry.locations):
            tier = self.tiers[tier_index]
            entry.start_read()
            try:
                got = await tier.get(raw)
            except DeviceError as exc:
                self._counters.device_errors += 1
                log.warning("tier %s failed to read an object: %s", tier.name, exc)
                continue  # the copy may still be fine; a slower tier may answer
            finally:
                entry.end_read()
            if self._index.get(raw) is not entry:
                return None  # replaced or invalidated while we read
            if got is not None and got[0].generation == entry.generation:
                self._counters.hits[tier.name] += 1
                self._lru[tier_index].touch(raw, time.monotonic())
                return got
            # the tier lost this copy (it failed its checksum): forget it
            self._counters.corrupt_reads += 1
            entry.remove_location(tier_index)
            self._lru[tier_index].remove(raw)
            if not entry.locations:
                self._unindex(raw)
        return None

    def _decode(self, meta: ObjectMeta, payload: Payload) -> bytes | torch.Tensor:
        value = decode_value(meta, payload)
        if isinstance(value, torch.Tensor) and value.device != self.device:
            value = value.to(self.device)
        return value

    # -- writes ----------------------------------------------------------------------------------
    async def put(self, key: Key, value: Value, *, parents: Iterable[Key] = ()) -> None:
        """Store `value` under `key`, replacing (and invalidating) any earlier value.

        `parents` are the keys this value derives from. With ``write_back`` the call returns once
        the first tier holds the object; with ``write_through`` once a persistent tier holds it.
        Raises `TierFullError` when no tier can hold it and `DeviceError` when every tier that
        could failed; in both cases the earlier value is gone and nothing else is lost.
        """
        self._check_open()
        raw = encode_key(key)
        meta, payload = encode_value(value, parents=tuple(encode_key(p) for p in parents))
        async with self._lock:
            self._check_open()
            await self._put_locked(raw, meta, payload)
        self._counters.puts += 1

    async def put_many(
        self, items: Mapping[KeyT, ValueT] | Iterable[tuple[KeyT, ValueT]]
    ) -> None:
        """`put` of every (key, value) pair, in order."""
        pairs = items.items() if isinstance(items, Mapping) else items
        for key, value in pairs:
            await self.put(key, value)

    async def _put_locked(self, raw: bytes, meta: ObjectMeta, payload: Payload) -> None:
        old = self._unindex(raw)
        if old is not None:
            await self._discard(raw, old)
        self._generation += 1
        entry = IndexEntry(meta.with_generation(self._generation))
        self._index[raw] = entry
        try:
            placed = await self._store(raw, entry, payload, 0)
            if self.config.engine.write_policy is WritePolicy.WRITE_THROUGH:
                await self._make_durable(raw, entry, payload, placed)
        except BaseException:
            if self._index.get(raw) is entry and not entry.locations:
                self._unindex(raw)
            raise

    async def _make_durable(
        self, raw: bytes, entry: IndexEntry, payload: Payload, placed: int
    ) -> None:
        """Write-through: a persistent tier holds the object, on media, before `put` returns."""
        if not self.tiers[placed].persistent:
            durable = next((i for i, t in enumerate(self.tiers) if t.persistent), None)
            if durable is None:
                return
            placed = await self._store(raw, entry, payload, durable)
        # a tier that buffers writes (the nvme log) puts them on media only when flushed
        await self.tiers[placed].flush()

    async def delete(self, key: Key) -> bool:
        """Remove `key` from every tier; whether it was stored."""
        self._check_open()
        raw = encode_key(key)
        async with self._lock:
            entry = self._unindex(raw)
            if entry is None:
                return False
            await self._discard(raw, entry)
            return True

    async def invalidate(self, key: Key) -> int:
        """Remove `key` from every tier; how many objects were removed (0 or 1 for now)."""
        removed = int(await self.delete(key))
        self._counters.invalidations += removed
        return removed

    async def flush(self) -> None:
        """Barrier: every object put before the call is on persistent media when it returns."""
        self._check_open()
        async with self._lock:
            await self._flush_locked()

    async def _flush_locked(self) -> None:
        durable = next((i for i, t in enumerate(self.tiers) if t.persistent), None)
        if durable is None:
            return
        for raw, entry in list(self._volatile.items()):
            if self._index.get(raw) is not entry or not entry.locations:
                continue
            got = await self._read_copy(raw, entry, entry.locations[0])
            if got is None:
                continue
            try:
                await self._store(raw, entry, got[1], durable)
            except (TierFullError, DeviceError) as exc:
                log.warning("flush could not persist an object: %s", exc)
        for tier in self.tiers:
            if tier.persistent:
                await tier.flush()

    # -- placement (all called with _lock held) --------------------------------------------------
    async def _store(self, raw: bytes, entry: IndexEntry, payload: Payload, start: int) -> int:
        """Put a copy into the first tier at or below `start` that takes it; its index."""
        nbytes = entry.meta.nbytes
        tier_index = first_tier_for(self.tiers, nbytes, start)
        failure: Exception | None = None
        while tier_index is not None:
            try:
                if await self._store_in(raw, entry, payload, tier_index):
                    return tier_index
            except DeviceError as exc:
                self._counters.device_errors += 1
                log.warning("tier %s failed a write: %s", self.tiers[tier_index].name, exc)
                failure = exc
            tier_index = first_tier_for(self.tiers, nbytes, tier_index + 1)
        if failure is not None:
            raise failure
        raise TierFullError(f"no tier can take an object of {nbytes} bytes")

    async def _store_in(self, raw: bytes, entry: IndexEntry, payload: Payload, index: int) -> bool:
        """Put a copy into tier `index`, evicting from it as needed; False if it cannot."""
        tier = self.tiers[index]
        nbytes = entry.meta.nbytes
        while True:
            while not tier.fits(nbytes):
                if not await self._evict_one(index, protect=raw):
                    break
            try:
                dropped = await tier.put(raw, entry.meta, payload)
            except TierFullError:
                if await self._evict_one(index, protect=raw):
                    continue
                return False
            break
        self._forget(dropped, index)
        if self._index.get(raw) is not entry:
            # a get that found the last copy corrupt forgot the key while we wrote
            await tier.delete(raw)
            return True
        entry.add_location(index)
        self._lru[index].insert(raw, time.monotonic())
        if tier.persistent:
            self._volatile.pop(raw, None)
        elif not any(self.tiers[i].persistent for i in entry.locations):
            self._volatile[raw] = entry
        return True

    def _forget(self, dropped: Iterable[bytes], tier_index: int) -> None:
        """Remove copies a tier dropped on its own from the index."""
        for key in dropped:
            entry = self._index.get(key)
            self._lru[tier_index].remove(key)
            if entry is None:
                continue
            entry.remove_location(tier_index)
            if not entry.locations:
                self._unindex(key)
                self._counters.drops += 1

    def _protected(self, tier_index: int, protect: bytes) -> Callable[[bytes], bool]:
        """What the scheduler must not pick: the key being placed, and pinned keys in L1."""
        pins = self._pins if tier_index == 0 else {}
        return lambda key: key == protect or key in pins

    async def _evict_one(self, tier_index: int, *, protect: bytes) -> bool:
        """Evict the scheduler's next victim from a tier; False if nothing can be evicted."""
        victim = self._lru[tier_index].victim(self._protected(tier_index, protect))
        if victim is None:
            return False
        await self._evict(victim, tier_index)
        return True

    async def _evict(self, key: bytes, tier_index: int) -> None:
        """Move an object out of a tier: demote it unless a lower tier already holds a copy."""
        tier = self.tiers[tier_index]
        self._lru[tier_index].remove(key)
        entry = self._index.get(key)
        if entry is None or tier_index not in entry.locations:
            await tier.delete(key)
            return
        self._counters.evictions[tier.name] += 1
        lower_copy = any(i > tier_index for i in entry.locations)
        target = None if lower_copy else demotion_target(self.tiers, tier_index, entry.meta.nbytes)
        if target is not None:
            got = await self._read_copy(key, entry, tier_index)
            if got is not None and self._index.get(key) is entry:
                try:
                    placed = await self._store(key, entry, got[1], target)
                    self._counters.demotions[self.tiers[placed].name] += 1
                except (TierFullError, DeviceError) as exc:
                    log.warning("demotion from %s failed, object dropped: %s", tier.name, exc)
        entry.remove_location(tier_index)
        await entry.wait_for_readers()
        await tier.delete(key)
        if not entry.locations and self._index.get(key) is entry:
            self._unindex(key)
            self._counters.drops += 1

    async def _read_copy(
        self, key: bytes, entry: IndexEntry, tier_index: int
    ) -> tuple[ObjectMeta, Payload] | None:
        entry.start_read()
        try:
            return await self.tiers[tier_index].get(key)
        except DeviceError as exc:
            self._counters.device_errors += 1
            log.warning("tier %s failed to read an object: %s", self.tiers[tier_index].name, exc)
            return None
        finally:
            entry.end_read()

    def _unindex(self, key: bytes) -> IndexEntry | None:
        """Remove a key from the index (and from what flush must persist); its entry, if any."""
        self._volatile.pop(key, None)
        return self._index.pop(key, None)

    async def _discard(self, key: bytes, entry: IndexEntry) -> None:
        """Delete every copy of an entry already removed from the index."""
        locations = list(entry.locations)
        entry.locations.clear()
        for tier_index in locations:
            self._lru[tier_index].remove(key)
        await entry.wait_for_readers()
        for tier_index in locations:
            try:
                await self.tiers[tier_index].delete(key)
            except DeviceError as exc:
                self._counters.device_errors += 1
                log.warning("tier %s failed a delete: %s", self.tiers[tier_index].name, exc)

    async def _expire_loop(self, ttl: float) -> None:
        """Move objects idle for longer than `ttl` out of the first tier."""
        interval = min(max(ttl / 4, 0.01), 1.0)
        while True:
            await asyncio.sleep(interval)
            try:
                stale = self._lru[0].idle(time.monotonic() - ttl)
                if not stale:
                    continue
                async with self._lock:
                    cutoff = time.monotonic() - ttl
                    for key in self._lru[0].idle(cutoff):
                        if key not in self._pins:
                            await self._evict(key, 0)
                            self._counters.expired += 1
            except Exception:
                log.exception("expiry of idle objects failed; will retry")

    # -- pins ------------------------------------------------------------------------------------
    def pin(self, key: Key) -> PinContext:
        """``async with kv.pin(key) as handle``: `handle.value` is the L1-resident tensor itself.

        The object is brought into the first (gpu) tier if needed and is neither evicted nor moved
        while any handle holds it. Raises `ObjectNotFound` if the key is not stored.
        """
        self._check_open()
        return PinContext(self, key)

    async def _pin_acquire(self, key: Key) -> tuple[PinToken, torch.Tensor, ObjectMeta]:
        raw = encode_key(key)
        first = self.tiers[0]
        if not isinstance(first, ZeroCopyPinning):
            raise TierKVError("pin needs a gpu tier first in the hierarchy")
        async with self._lock:
            self._check_open()
            entry = self._index.get(raw)
            if entry is None or not entry.locations:
                raise ObjectNotFound(key)
            if entry.locations[0] != 0:
                got = await self._read_copy(raw, entry, entry.locations[0])
                if got is None or self._index.get(raw) is not entry:
                    raise ObjectNotFound(key)
                if not await self._store_in(raw, entry, got[1], 0):
                    raise TierFullError("no room in the gpu tier to pin the object")
            token, flat = first.acquire_pin(raw)
            self._pins[raw] = self._pins.get(raw, 0) + 1
            self._lru[0].touch(raw, time.monotonic())
            return token, flat, entry.meta

    def _pin_release(self, key: bytes, token: PinToken) -> None:
        first = self.tiers[0]
        assert isinstance(first, ZeroCopyPinning)
        first.release_pin(token)
        remaining = self._pins[key] - 1
        if remaining:
            self._pins[key] = remaining
        else:
            del self._pins[key]

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        engine = self._counters.to_dict()
        engine.update(
            objects=len(self._index),
            unflushed=len(self._volatile),
            pinned=len(self._pins),
            write_policy=self.config.engine.write_policy.value,
        )
        return {"engine": engine, "tiers": {tier.name: tier.stats() for tier in self.tiers}}
