"""The shared tier on Redis or Redis Cluster: the last level, common to every engine of a fleet.

Each object is one string value: the record of `tierkv.formats.shared_record` (header + payload)
under ``key_prefix + b"o:" + canonical key``, so tenants (whose namespaces are in every
`BlockKey` digest) and deployments (`key_prefix`) never see each other's objects. A value that
does not decode as the record of its key is a counted miss, never bytes.

What this engine holds here (`held`: what it wrote or adopted) is what `used` and `capacity`
count: engines sharing a server each stay within their own share, and the server's `maxmemory`
or the `ttl` bounds the whole. Another engine may delete or overwrite an object at any time; a
get then misses, also on a record of another write stamp (the engine adopts it on its next
lookup). `fetch_many` reads objects this engine does not hold (one pipelined round trip per
`batch` keys) and `adopt` takes one into `held`. Every call is bounded by `timeout`; a server
down, slow or answering an error raises `DeviceError`; redis-py reconnects on the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from tierkv._deadline import CutOffs
from tierkv._untracked import untrack
from tierkv.config import RedisTierConfig, TierKind
from tierkv.errors import CorruptObjectError, DeviceError, TierFullError
from tierkv.formats.header import checksum
from tierkv.formats.shared_record import SharedRecord, decode_record, encode_record_header
from tierkv.formats.value import ObjectMeta, Payload, payload_view
from tierkv.tiers.base import RecoveredObject, Tier
from tierkv.tiers.redis._batch import SetBatcher
from tierkv.tiers.redis._client import hiredis_available, import_client, make_client
from tierkv.tiers.redis._fleet import Fleet
from tierkv.tiers.redis._joined import record_value

T = TypeVar("T")

#: what a GET of a value of another type reads as: bytes that decode as no record
_FOREIGN = b""


def _wrong_type(error: Exception) -> bool:
    """Whether a reply error is the server's WRONGTYPE (a key holding a list, a hash, ...)."""
    return str(error).startswith("WRONGTYPE")
#: bytes the server spends per object beyond the payload: the record header (with the key and
#: its parents) and Redis's own key and value overhead, as `footprint` counts it
RECORD_OVERHEAD = 256


@dataclass(slots=True)
class _Held:
    """What this engine knows of its copy on the server: the engine's generation, and the
    record's stamp and payload checksum (a record with others was written by another engine).
    For a record this engine wrote, also its meta and the length and checksum of its header:
    a value whose header and payload checksum as written is that record, byte for byte, and is
    served without decoding its header again."""

    generation: int
    stamp: int
    checksum: int
    footprint: int
    meta: ObjectMeta | None = None
    header_length: int = 0
    header_checksum: int = 0

    def __post_init__(self) -> None:
        untrack(self)  # atoms only: no cycle can pass through it (`tierkv._untracked`)

    def written(self, value: bytes) -> tuple[ObjectMeta, memoryview] | None:
        """`value` as the record this engine wrote, or None (not known, or not that record)."""
        meta, length = self.meta, self.header_length
        if meta is None or len(value) != length + meta.nbytes:
            return None
        view = memoryview(value)
        payload = view[length:]
        if checksum(view[:length]) != self.header_checksum or checksum(payload) != self.checksum:
            return None
        return meta, payload


class RedisTier(Tier):
    kind: ClassVar[TierKind] = TierKind.REDIS
    shared: ClassVar[bool] = True

    def __init__(self, config: RedisTierConfig) -> None:
        super().__init__(config.name)
        self.config = config
        self.queue_depth = config.pool_size
        self._prefix = config.key_prefix.encode()
        self._client: Any = None
        #: the fleet log follower's own client (one connection)
        self._follower: Any = None
        self._held: dict[bytes, _Held] = {}
        self._used = 0
        self.fleet: Fleet | None = None
        #: puts of one turn of the loop, sent together (`_batch`)
        self._sets: SetBatcher | None = None
        #: calls in flight at once: redis-py's pools raise `MaxConnectionsError` rather than wait
        #: for a connection, and the fleet's blocking read holds one of them
        self._slots = asyncio.Semaphore(config.pool_size)
        #: every call's bound (the clients have no timeouts of their own, `make_client`)
        self._cut_offs = CutOffs(config.timeout)
        self._counters = {"hits": 0, "misses": 0, "corrupt": 0, "superseded": 0,
                          "lookups": 0, "lookup_hits": 0, "round_trips": 0, "errors": 0}

    # -- lifecycle -------------------------------------------------------------------------------
    async def _open(self) -> list[RecoveredObject]:
        import_client()
        self._client = make_client(self.config)
        try:
            await self._call(self._client.ping())
        except DeviceError:
            await self._disconnect()
            raise
        self._sets = SetBatcher(lambda: self._client.pipeline(transaction=False), self._call,
                                self.config.batch, f"redis tier {self.name!r}")
        self._follower = make_client(self.config)
        self.fleet = Fleet(self.config, self._client, self._call, self._follower,
                           self._unpooled)
        try:
            await self.fleet.start()
        except BaseException:
            # an open that fails leaves no connection behind (nothing will close this tier)
            await self.fleet.stop()
            self.fleet = None
            await self._disconnect()
            raise
        return []

    async def ping(self) -> None:
        """One PING, the tier not opened (its survey may write); `DeviceError` if unanswered."""
        self._client = make_client(self.config)
        try:
            await self._call(self._client.ping())
        finally:
            await self._disconnect()

    async def _close(self) -> None:
        if self.fleet is not None:
            await self.fleet.stop()
        if self._sets is not None:
            await self._sets.drain()
        await self._disconnect()

    async def _disconnect(self) -> None:
        for client in (self._follower, self._client):
            if client is not None:
                # a broken connection: nothing to release; a server that does not take the
                # close: bounded here (the client has no timeout of its own, `make_client`)
                with contextlib.suppress(Exception), self._cut_offs():
                    await client.aclose()
        self._client = self._follower = None

    # -- calls -------------------------------------------------------------------------------
    async def _call(self, call: Awaitable[T]) -> T:
        """`call`, bounded by the timeout (waiting for one of the `pool_size` connections
        included); a failure of the server or the network is a `DeviceError` naming the
        server (never its credentials)."""
        return await self._unpooled(self._holding_a_slot(call))

    async def _holding_a_slot(self, call: Awaitable[T]) -> T:
        try:
            async with self._slots:
                return await call
        finally:
            if isinstance(call, Coroutine):
                call.close()  # never awaited: it timed out or was cancelled waiting for a slot

    async def _unpooled(self, call: Awaitable[T]) -> T:
        """`_call` on a connection of its own (the fleet log's follower, whose blocking read
        would otherwise hold one of the data path's connections half the time)."""
        redis = import_client()
        try:
            with self._cut_offs():
                return await call
        except TimeoutError:
            self._counters["errors"] += 1
            raise DeviceError(f"redis tier {self.name!r}: {self.config.display_url} did not "
                              f"answer within {self.config.timeout:g}s") from None
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            self._counters["errors"] += 1  # a cluster's are no RedisErrors (unreachable: open)
            raise DeviceError(f"redis tier {self.name!r}: {self.config.display_url}: "
                              f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:
            self._counters["errors"] += 1
            raise DeviceError(f"redis tier {self.name!r}: {self.config.display_url}: "
                              f"{exc}") from None

    def server_key(self, key: bytes) -> bytes:
        return self._prefix + b"o:" + key

    # -- space -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def used(self) -> int:
        return self._used

    def footprint(self, nbytes: int) -> int:
        return nbytes + RECORD_OVERHEAD

    # -- data path ---------------------------------------------------------------------------
    async def put(self, key: bytes, meta: ObjectMeta, payload: Payload) -> Sequence[bytes]:
        self._check_open()
        footprint = self.footprint(meta.nbytes)
        previous = self._held.get(key)
        if self._used - (previous.footprint if previous else 0) + footprint > self.capacity:
            raise TierFullError(f"redis tier {self.name!r} has no room for {meta.nbytes} bytes")
        assert self.fleet is not None
        stamp = self.fleet.cursor
        view = payload_view(payload)
        header, payload_checksum = encode_record_header(key, meta, view, stamp)
        record = record_value(header, payload if type(payload) is bytes else view)
        assert self._sets is not None
        ttl_ms = None if self.config.ttl is None else int(self.config.ttl * 1000)
        answered = self._sets.set(self.server_key(key), record, ttl_ms)
        # what was held goes first: a failed or cancelled put may have replaced it on the server
        self._forget(key)
        # bounded by the round trip's timeout (`_call`); a cancelled caller cancels its future only
        try:
            await answered
        except BaseException:
            # future → error → traceback → this frame → future: the cycle kept `payload` (a
            # gpu slot's view) alive until a full collection; a full server failed every put
            del answered
            raise
        self._hold(key, _Held(meta.generation, stamp, payload_checksum, footprint, meta,
                              len(header), checksum(header)))
        return ()

    async def get(self, key: bytes) -> tuple[ObjectMeta, Payload] | None:
        self._check_open()
        held = self._held.get(key)
        if held is None:
            self._counters["misses"] += 1
            return None
        self._counters["round_trips"] += 1
        value = await self._call(self._get(self.server_key(key)))
        return self._served(key, held, value)

    async def _get(self, server_key: bytes) -> bytes | None:
        """GET of one key; a value of another type there (a list, a hash: not ours) reads as
        a value that is no record, a counted miss of that key, not a failing server."""
        redis = import_client()
        try:
            value: bytes | None = await self._client.get(server_key)
        except redis.exceptions.ResponseError as exc:
            if not _wrong_type(exc):
                raise
            return _FOREIGN
        return value

    async def get_many(self, keys: Sequence[bytes]) -> list[tuple[ObjectMeta, Payload] | None]:
        """One pipelined round trip per `batch` keys held here (the others miss at once)."""
        self._check_open()
        asked = [key for key in keys if key in self._held]
        values = dict(zip(asked, await self._mget(asked), strict=True))
        results: list[tuple[ObjectMeta, Payload] | None] = []
        for key in keys:
            held = self._held.get(key)
            if held is None or key not in values:
                self._counters["misses"] += 1
                results.append(None)
            else:
                results.append(self._served(key, held, values[key]))
        return results

    def _served(self, key: bytes, held: _Held, value: bytes | None
                ) -> tuple[ObjectMeta, Payload] | None:
        if self._held.get(key) is not held:  # deleted or replaced while we read
            self._counters["misses"] += 1
            return None
        written = None if value is None else held.written(value)
        if written is not None:
            self._counters["hits"] += 1
            return written
        record = self._decoded(key, value)
        if record is None or (record.stamp, record.checksum) != (held.stamp, held.checksum):
            if record is not None:
                self._counters["superseded"] += 1  # another engine wrote the key since
            self._forget(key)
            self._counters["misses"] += 1
            return None
        self._counters["hits"] += 1
        return record.meta.with_generation(held.generation), record.payload

    def _decoded(self, key: bytes, value: bytes | None) -> SharedRecord | None:
        if value is None:
            return None
        try:
            return decode_record(key, value)
        except CorruptObjectError:
            self._counters["corrupt"] += 1
            return None

    async def _mget(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of `keys`, `batch` per pipelined round trip."""
        values: list[bytes | None] = []
        batch = self.config.batch
        for start in range(0, len(keys), batch):
            pipe = self._client.pipeline(transaction=False)
            for key in keys[start:start + batch]:
                pipe.get(self.server_key(key))
            self._counters["round_trips"] += 1
            replies = await self._call(pipe.execute(raise_on_error=False))
            for reply in replies:
                if not isinstance(reply, Exception):
                    values.append(reply)
                elif _wrong_type(reply):
                    values.append(_FOREIGN)  # as in `_get`: that key misses, not the batch
                else:
                    raise DeviceError(f"redis tier {self.name!r}: "
                                      f"{self.config.display_url}: {reply}")
        return values

    async def fetch_many(self, keys: Sequence[bytes]) -> list[SharedRecord | None]:
        """Records of keys this engine does not hold (its local misses), for `adopt`: one
        pipelined round trip per `batch` keys; a value that is not a record of its key is a
        counted miss."""
        self._check_open()
        self._counters["lookups"] += len(keys)
        records = [self._decoded(key, value)
                   for key, value in zip(keys, await self._mget(keys), strict=True)]
        self._counters["lookup_hits"] += sum(record is not None for record in records)
        return records

    def adopt(self, key: bytes, generation: int, record: SharedRecord) -> None:
        """Hold `record` (fetched by `fetch_many`) as this engine's copy of `key`, under the
        engine's `generation`."""
        self._forget(key)
        self._hold(key, _Held(generation, record.stamp, record.checksum,
                              self.footprint(record.meta.nbytes)))

    def forget(self, key: bytes) -> bool:
        """Stop holding `key` without deleting it on the server (another engine invalidated
        it: its record there is that engine's to delete, or newer than the invalidation)."""
        return self._forget(key)

    async def delete(self, key: bytes) -> bool:
        self._check_open()
        existed = self._forget(key)
        self._counters["round_trips"] += 1
        removed = await self._call(self._client.unlink(self.server_key(key)))
        return existed or bool(removed)

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        """Delete `keys` on the server whether held here or not (a fleet invalidation), one
        pipelined round trip per `batch`."""
        self._check_open()
        for key in keys:
            self._forget(key)
        batch = self.config.batch
        for start in range(0, len(keys), batch):
            pipe = self._client.pipeline(transaction=False)
            for key in keys[start:start + batch]:
                # not `pipe.unlink`: a cluster pipeline's is a coroutine that queues nothing
                # until awaited
                pipe.execute_command("UNLINK", self.server_key(key))
            self._counters["round_trips"] += 1
            await self._call(pipe.execute())

    async def contains(self, key: bytes) -> bool:
        self._check_open()
        if key not in self._held:
            return False
        return bool(await self._call(self._client.exists(self.server_key(key))))

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._held))

    def _hold(self, key: bytes, held: _Held) -> None:
        self._held[key] = held
        self._used += held.footprint

    def _forget(self, key: bytes) -> bool:
        held = self._held.pop(key, None)
        if held is None:
            return False
        self._used -= held.footprint
        return True

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update(self._counters, held=len(self._held), shared=True)
        if self._sets is not None:
            stats["round_trips"] += self._sets.round_trips
        if self.fleet is not None:
            stats.update(self.fleet.stats())
        return stats

    def describe(self) -> dict[str, str]:
        mode = "cluster" if self.config.url is None else "standalone"
        return {"server": self.config.display_url, "mode": mode,
                "client": "redis-py asyncio" + (" + hiredis" if hiredis_available() else ""),
                "key prefix": self.config.key_prefix}
