"""The Tier contract: what every storage tier (GPU slots, PMem pool, NVMe log) promises.

A tier is a *mechanism*: it stores and returns the bytes of the keys it is told about. It never
decides where an object should live; the engine owns the index (key → tiers) and asks the
scheduler for policy. Keys are canonical byte strings (`tierkv.keys.encode_key`).

Lifecycle: ``CREATED → open() → OPEN → close() → CLOSED``. `open` prepares the device and returns
what it recovered from the media (nothing for a volatile tier); `close` is idempotent. Every other
coroutine raises `EngineClosedError` unless the tier is open.

Buffers: `put` copies the payload before it returns, so the caller may reuse its buffer at once.
`get` returns a payload the caller owns (never a view of tier memory that could be reused).

Space: a tier never holds more than `capacity` bytes (counted as `footprint`, i.e. with slot or
alignment rounding). Tiers whose objects are freed one by one (GPU, PMem) answer `fits()` and
raise `TierFullError` from `put` when the object does not fit; the engine then evicts victims the
scheduler picks and retries. Log-structured tiers (NVMe, `reclaims_space`) reclaim whole regions
themselves: their `put` returns the keys it dropped to make room; an owner that must know at once
(the engine's index, whose later operations on those keys must not be undone by a late report)
registers a drop listener, which the tier calls on the loop, synchronously, in the same step that
drops the keys: before any later operation on the tier can store them again, saying whether it
dropped them for room (a reclaim: an eviction, which the owner may follow through above) or
because their copies failed (a failed write, a failed checksum: copies elsewhere stay good).
Which live entries of a reclaimed region such a tier copies forward instead of dropping is the
owner's to say where it registers what keeping each is worth (it knows what the cache holds
elsewhere and what each object is worth); without that the tier's own rule decides.

Durability: `flush()` makes everything put before it durable; between flushes `on_media(key)`
says whether one copy already is (a write-through tier's at once; the nvme log's once a sync
covered its write), which the engine asks before it writes below a key whose edges only that
copy's header holds.

Concurrency: all coroutines may be called concurrently from tasks of one event loop. A `get`
that overlaps a `delete` of the same key returns either the whole object or ``None``. The owner
orders operations on one key (the engine never runs two writes or deletes of a key into one tier
at once); operations on different keys run concurrently down to the device queue, whose depth
bounds what is in flight (`get_many` included).

Cancellation: every coroutine may be cancelled at any await. A cancelled `put` leaves the key
with its old object, the new one, or none, and every other key untouched; a cancelled `get`
leaves nothing held (readers, buffers). Background work a call started (region writes, copies on
worker threads) is never cancelled because the caller waiting on it was.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from tierkv._concurrency import bounded_map
from tierkv.config.schema import TierKind
from tierkv.errors import EngineClosedError
from tierkv.formats.value import ObjectMeta, Payload

#: what `Tier.set_drop_listener` registers: called with the keys a tier dropped on its own,
#: and whether it dropped them for room (True) or because their copies failed (False)
DropListener = Callable[[Sequence[bytes], bool], None]
#: what `Tier.set_reclaim_worth` registers: what copying a live entry of a region being
#: reclaimed forward is worth (0 or less: drop it; infinite: it must stay; ``None``: the
#: tier's own rule decides for this entry)
ReclaimWorth = Callable[[bytes], float | None]


class TierState(enum.Enum):
    CREATED = "created"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RecoveredObject:
    """An object a persistent tier found intact on its media at open."""

    key: bytes
    meta: ObjectMeta


class Tier(ABC):
    """Base class of every tier; subclasses implement the `_`-prefixed hooks and the data path."""

    kind: ClassVar[TierKind]
    persistent: ClassVar[bool] = False
    #: the tier frees space itself (whole regions) and reports what it dropped, instead of
    #: raising `TierFullError` for the owner to evict; the engine runs no evictor for it
    reclaims_space: ClassVar[bool] = False
    #: other engines read and write the tier too (the redis tier): the engine looks up its
    #: local misses there, copies every put there in the background, and never moves an
    #: object out of it (a promotion copies)
    shared: ClassVar[bool] = False
    #: requests in flight at once in `get_many` (tiers set it from their queue depth)
    queue_depth: int = 32

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = TierState.CREATED
        self._drop_listener: DropListener | None = None
        self._space_listener: Callable[[], None] | None = None

    def set_drop_listener(self, listener: DropListener | None) -> None:
        """Call `listener(keys, for_room)` whenever the tier drops keys on its own (see the module
        docstring); at most one listener, ``None`` removes it."""
        self._drop_listener = listener

    def set_space_listener(self, listener: Callable[[], None] | None) -> None:
        """Call `listener()` whenever space is freed other than by a `delete` returning (a
        pinned or lent allocation freed when its last pin or view goes): writers waiting for
        room learn of it."""
        self._space_listener = listener

    def set_reclaim_worth(self, worth: ReclaimWorth | None) -> None:
        """For a tier that reclaims space (`reclaims_space`): ask `worth(key)`, for each live
        entry of a region it reclaims, what copying the entry forward rather than dropping it
        is worth; entries worth more than 0 are copied, the most valuable first, as far as
        they leave room for what the reclaim is for; entries worth infinitely much are copied
        even where the tier's config turns copying forward off (the only durable copy of
        something its owner cannot lose). Called on the loop, synchronously, before the
        reclaim reads anything (and again for the rest after its reads). ``None`` (for the
        tier, or as an entry's worth): the tier's own rule decides. Other tiers ignore it
        (this default)."""
        del worth  # a tier that frees objects one by one reclaims no regions

    def _space_freed(self) -> None:
        if self._space_listener is not None:
            self._space_listener()

    def _dropped(self, keys: Sequence[bytes], for_room: bool = False) -> None:
        """Report keys the tier dropped on its own, for room or not; subclasses call it as
        they drop them."""
        if keys and self._drop_listener is not None:
            self._drop_listener(keys, for_room)

    # -- lifecycle -------------------------------------------------------------------------------
    async def open(self) -> list[RecoveredObject]:
        """Prepare the device and return the objects recovered from it (volatile tiers: none)."""
        if self.state is not TierState.CREATED:
            raise EngineClosedError(f"tier {self.name!r} cannot be opened twice")
        recovered = await self._open()
        self.state = TierState.OPEN
        return recovered

    async def close(self) -> None:
        """Release the device; persistent tiers make what they hold durable first. Idempotent."""
        if self.state is TierState.OPEN:
            self.state = TierState.CLOSED
            await self._close()
        self.state = TierState.CLOSED

    def damaged_at_open(self) -> frozenset[bytes]:
        """Keys whose newest record on the media `open` found damaged (it failed a checksum
        while its object header, checksummed apart, still named the key): the tier does not
        hold them, and they are not among what `open` returned. A record damaged past that
        names no key; one found damaged only at `get` (not read at open) is a miss there. So
        an owner can tell an object of its own that was damaged from one never written.
        Empty for a tier that keeps nothing on media (this default)."""
        return frozenset()

    @abstractmethod
    async def _open(self) -> list[RecoveredObject]: ...

    @abstractmethod
    async def _close(self) -> None: ...

    def _check_open(self) -> None:
        if self.state is not TierState.OPEN:
            raise EngineClosedError(f"tier {self.name!r} is {self.state.value}")

    # -- space -----------------------------------------------------------------------------------
    @property
    @abstractmethod
    def capacity(self) -> int:
        """Bytes this tier may occupy."""

    @property
    @abstractmethod
    def used(self) -> int:
        """Bytes occupied now (footprints, not payload lengths)."""

    def footprint(self, nbytes: int) -> int:
        """Bytes an object of `nbytes` payload bytes occupies in this tier."""
        return nbytes

    def fits(self, nbytes: int) -> bool:
        """Whether an object of `nbytes` can be put now without anything being evicted."""
        return self.used + self.footprint(nbytes) <= self.capacity

    def can_ever_hold(self, nbytes: int) -> bool:
        """Whether an object of `nbytes` fits into this tier when it is empty."""
        return self.footprint(nbytes) <= self.capacity

    def room(self) -> int:
        """Footprint bytes puts may take now without the tier dropping or evicting anything
        (a tier that reclaims space itself counts only space that holds nothing)."""
        return max(self.capacity - self.used, 0)

    # -- data path -------------------------------------------------------------------------------
    @abstractmethod
    async def put(self, key: bytes, meta: ObjectMeta, payload: Payload) -> Sequence[bytes]:
        """Store `payload` under `key`, replacing any earlier object of that key.

        Returns the keys the tier dropped on its own to make room (log-structured tiers only).
        Raises `TierFullError` when the object does not fit and `DeviceError` when the device
        fails; in both cases nothing already stored under other keys is lost.
        """

    @abstractmethod
    async def get(self, key: bytes) -> tuple[ObjectMeta, Payload] | None:
        """The object's meta and a payload the caller owns, or ``None`` on a miss.

        A persistent tier verifies the checksum and answers ``None`` (and counts it) instead of
        returning bytes that fail it. Raises `DeviceError` when the device fails.
        """

    async def get_many(self, keys: Sequence[bytes]) -> list[tuple[ObjectMeta, Payload] | None]:
        """`get` of every key, at most `queue_depth` at once, results in order."""
        return await bounded_map(self.get, keys, self.queue_depth)

    @abstractmethod
    async def delete(self, key: bytes) -> bool:
        """Remove the object; whether there was one."""

    @abstractmethod
    async def contains(self, key: bytes) -> bool:
        """Whether the tier holds an object under `key`."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """The keys held now (a snapshot; safe to mutate the tier while iterating)."""

    def on_media(self, key: bytes) -> bool:
        """Whether the copy of `key` this tier holds (the caller knows it holds one) is synced
        to its media now, so that it outlives a crash of the process or of the machine. Most
        persistent tiers write through (this default: what they hold is on media); the nvme
        log answers ``False`` for what sits in its buffers, or was written since its last
        sync, until a flush (or its own write and a later flush's sync) puts it there."""
        del key
        return self.persistent

    def forget(self, key: bytes) -> bool:
        """Stop holding `key` without deleting it (shared tiers only: another engine's
        invalidation); whether it was held."""
        raise NotImplementedError(f"a {self.kind.value} tier is not shared")

    async def flush(self) -> None:
        """Make everything put so far durable (a no-op for volatile tiers)."""
        self._check_open()

    async def time_read(self, nbytes: int) -> float | None:
        """Seconds one read of `nbytes` from this tier's media takes now, where the tier times
        that itself; ``None`` where reading a stored object back times it (the engine's profile
        probe then does). A log serves its newest entries from memory: timing a probe object it
        was just given would time memory, not the device."""
        self._check_open()
        return None

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and gauges for `Engine.stats()`; subclasses extend the dict."""
        return {
            "kind": self.kind.value,
            "capacity": self.capacity,
            "used": self.used,
            "persistent": self.persistent,
        }

    def describe(self) -> dict[str, str]:
        """What was detected about the device, for `tierkv info` (one line per entry)."""
        return {}


class PinToken(Protocol):
    """An opaque handle on one resident allocation, returned by `ZeroCopyPinning.acquire_pin`."""


@runtime_checkable
class ZeroCopyPinning(Protocol):
    """A tier that can lend its resident memory out as a tensor (the GPU tier).

    While a token is held, the allocation it names is neither evicted, moved nor reused, even if
    the key is deleted or overwritten meanwhile (the memory is freed when the last pin goes).
    """

    def acquire_pin(self, key: bytes) -> tuple[PinToken, torch.Tensor]:
        """Pin the object under `key`; `KeyError` if absent. The tensor aliases tier memory."""
        ...

    def lend_host(self, key: bytes) -> tuple[PinToken, memoryview] | None:
        """As `acquire_pin`, with a byte view instead of a tensor, where the object is in host
        memory (``None`` elsewhere: on a CUDA device): what the engine copies into another tier
        from, without making a tensor. The memory stays reserved while the view, or any view
        made from it, lives (a copy a worker thread still makes), even past `release_pin`."""
        ...

    def release_pin(self, token: PinToken) -> None:
        """Give a pin back (exactly once per `acquire_pin` or `lend_host`)."""
        ...

    def is_pinned(self, key: bytes) -> bool:
        """Whether the current object under `key` has a live pin."""
        ...

    async def contains(self, key: bytes) -> bool:
        """As `Tier.contains`."""
        ...
