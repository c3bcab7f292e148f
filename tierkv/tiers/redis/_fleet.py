"""The fleet's invalidation log: a Redis stream under the tier's `key_prefix`.

Every engine sharing a server appends what it invalidates (the keys its cascade removed, the
invalidated key itself first) and follows what the others append. A stream rather than pub/sub
because an engine that was disconnected reads on from where it stopped: it misses nothing that
the stream still holds (entries older than `retention` are trimmed).

Entry ids order everything. An id ``ms-seq`` (server time) is used as the integer
``ms << 20 | seq`` (`entry_order`). Each engine keeps a *cursor*: the order of the last entry
whose invalidations it has applied to its own tiers. A record it writes to the shared tier is
stamped with that cursor (`tierkv.formats.shared_record`), so a record is stale exactly when an
entry that invalidates its key or one of its ancestors is ordered after its stamp: its writer
had not applied that invalidation when it wrote the record. No clocks are compared. An engine
that publishes waits until its own entry has come back through its follower (`publish`), so its
next records are stamped after it.

`tombs` maps each key the retained log invalidated to the order of the latest entry naming it.
`horizon`: entries up to this order were trimmed (the newest trimmed, which the publisher that
trimmed it records, `_APPEND`); a record stamped before it cannot be checked and is refused.
So a tomb at or below the horizon decides nothing, and the follower drops those: each time the
tombs have doubled since the last time (from `PRUNE_AT`), it surveys the log again for its
horizon (`_read_horizon`, which also finds unread entries trimmed away) and keeps the tombs
above it. Without that, an engine kept one tomb per key the fleet ever invalidated (every
overwrite publishes its key), for as long as it ran: the tombs follow the retention instead.

A log can also be lost whole: a server restarted without persistence, a `FLUSHALL`, a stream
evicted under `maxmemory`. The log then has no horizon to say so, and reads as one where nothing
happened. So each log has an *epoch*, a random id set beside it by the first engine that finds
none (`_SURVEY`), and a position in the log is checked where it was read (`reaches`): a cursor
after the horizon must still name an entry of the stream, and a cursor at the start (no entry
read yet) must be of the same epoch, as must any position whose epoch is known (a follower
may read on into a new log whose first entry came before its survey, its cursor then naming
an entry there). Where any of this fails, what was invalidated meanwhile cannot
be known, and the engine drops what it holds, as for a trimmed history. The follower surveys
the log once a second while it reads it, not only when it reconnects: a log lost under a live
connection fails no read, and a follower that had not read the last entries served what they
invalidated for good. A log lost or rolled back (a restart from an older snapshot, a failover
onto a replica that lagged) may also have brought back records of keys its lost entries had
invalidated, and an engine started later finds no tomb for them: so a running engine that
finds its log lost or rolled back (not merely trimmed) hands the keys of the tombs it holds to
its lost listener, which publishes them again (`Shared`): those keys miss across the fleet,
never the values they replaced.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgpack

from tierkv._deadline import stall_aware_timeout
from tierkv.config import RedisTierConfig
from tierkv.errors import DeviceError

log = logging.getLogger("tierkv.tiers.redis")
Call = Callable[[Awaitable[Any]], Awaitable[Any]]
#: called with the keys another engine invalidated; returns once they are gone here
Listener = Callable[[list[bytes], int], Awaitable[None]]
#: called when entries this engine had not read are gone (trimmed away, or the log lost or rolled
#: back): it cannot know what it missed; with the keys of the tombs the log may have lost
#: (`_read_horizon`), for the fleet to be told again
LostListener = Callable[[list[bytes]], Awaitable[None]]
_SEQ_BITS = 20
#: entries one read of the log takes at most
_PAGE = 512
#: the longest the follower waits before trying a lost connection again
_MAX_BACKOFF = 2.0
#: bytes of keys one entry of the log carries at most (`_entries`)
ENTRY_BYTES = 256 << 10
#: seconds between two surveys of the log while the follower reads it (`_follow`)
SURVEY_EVERY = 1.0
#: tombs the follower holds before it first drops those at or below the horizon (then twice
#: what it kept: a survey and a pass over the tombs per as many new ones, amortised)
PRUNE_AT = 1024


#: appends an entry and trims what is older than the retention, atomically, keeping the id of
#: the newest entry trimmed as the log's horizon (Redis 7.0 reports trims nowhere: its
#: `max-deleted-entry-id` counts only XDEL). KEYS: the stream, the horizon; ARGV: the oldest id
#: kept, this engine's origin mark, the msgpack list of keys.
_APPEND = """
local gone = redis.call('XREVRANGE', KEYS[1], '(' .. ARGV[1], '-', 'COUNT', 1)
if #gone > 0 then
    redis.call('SET', KEYS[2], gone[1][1])
    redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1])
end
return redis.call('XADD', KEYS[1], '*', 'o', ARGV[2], 'k', ARGV[3])
"""


#: what a follower must know of the log when it (re)connects: its epoch (set here if none),
#: its horizon, and whether the entry of a cursor is still in it. KEYS: the stream, the epoch,
#: the horizon; ARGV: an epoch to set if there is none, the cursor's entry id ("0-0": none).
_SURVEY = """
redis.call('SET', KEYS[2], ARGV[1], 'NX')
local found = 0
if ARGV[2] ~= '0-0' then
    found = #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
end
return {redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3]) or false, found}
"""


def _reaches(cursor: int, epoch: bytes | None, survey: tuple[bytes, int, bool]) -> bool:
    """`Fleet.reaches` of a survey of the log (`_SURVEY`): never from another log (`epoch`
    known and not the log's now); a cursor at or before the horizon reaches it only if it is
    the horizon (nothing after it was trimmed); one after it only if its entry is still there.
    The epoch decides also where the cursor's entry is there: a follower that read on into a
    new log (another engine's first invalidation in it came before its survey) holds a cursor
    naming an entry of the new log, and took the loss of the old one for nothing."""
    epoch_now, horizon, found = survey
    if epoch is not None and epoch != epoch_now:
        return False
    if cursor > 0:
        return cursor == horizon if cursor <= horizon else found
    return True


def _entries(keys: Sequence[bytes]) -> list[list[bytes]]:
    """`keys` cut into the lists of one log entry each, `ENTRY_BYTES` of keys at most (one key
    longer than that alone): an invalidation of a whole model in one entry exceeded the
    server's `proto-max-bulk-len`, which refused it every time it was sent again, and the other
    engines never learned of it. Each entry is applied on its own, in order; a record is stale
    after the entry naming its key (`tombs`), wherever the rest of the invalidation lies."""
    entries: list[list[bytes]] = [[]]
    size = 0
    for key in keys:
        if entries[-1] and size + len(key) + 5 > ENTRY_BYTES:
            entries.append([])
            size = 0
        entries[-1].append(key)
        size += len(key) + 5  # msgpack's widest bin header
    return entries


def entry_order(entry_id: bytes | str) -> int:
    """The integer order of a stream entry id ``ms-seq``."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return (int(ms) << _SEQ_BITS) | min(int(seq or 0), (1 << _SEQ_BITS) - 1)


def _entry_id(order: int) -> str:
    return f"{order >> _SEQ_BITS}-{order & ((1 << _SEQ_BITS) - 1)}"


class Fleet:
    def __init__(self, config: RedisTierConfig, client: Any, call: Call, follower: Any,
                 follow_call: Call) -> None:
        self._config = config
        self._client = client
        self._call = call
        #: the follower's blocking reads go on a connection of their own
        self._follower = follower
        self._follow_call = follow_call
        prefix = config.key_prefix.encode()
        # one hash tag: the log and its horizon live in one cluster slot, for `_APPEND`
        self.stream = prefix + b"{fleet}:invalidations"
        self.horizon_key = prefix + b"{fleet}:horizon"
        self.epoch_key = prefix + b"{fleet}:epoch"
        #: the log's epoch (`reaches`), as the last survey of it found it
        self.epoch = b""
        #: this engine's mark on its entries, so that its follower does not apply them twice
        self.origin = os.urandom(8)
        self.tombs: dict[bytes, int] = {}
        #: the follower drops the tombs at or below the horizon once there are this many
        self._prune_at = PRUNE_AT
        self.horizon = 0
        self.cursor = 0
        self._listener: Listener | None = None
        self._lost: LostListener | None = None
        self._advanced = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.connected = True
        self._counters = {"invalidations_published": 0, "invalidations_received": 0,
                          "keys_invalidated_remotely": 0, "log_reconnects": 0,
                          "log_history_lost": 0}

    def set_listeners(self, listener: Listener | None, lost: LostListener | None) -> None:
        self._listener, self._lost = listener, lost

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Read the retained log (tombs, horizon, cursor), then follow it in the background."""
        await self._read_horizon()
        while await self._read_page(block=False):
            pass
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def stop(self) -> None:
        task, self._task = self._task, None
        # the flag ends the follower too: on Python 3.11 a cancel can be lost inside redis-py
        # (its `asyncio.wait_for` returns a result it had when cancelled, cpython gh-86296),
        # and the follower would read on
        self._stopping = True
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # -- publishing --------------------------------------------------------------------------
    async def publish(self, keys: Sequence[bytes], *, read_back: bool = True) -> None:
        """Append an entry invalidating `keys`, then wait (at most the tier's timeout) until the
        follower has read it back, so that records written from now on are stamped after it.
        Not `read_back` (the follower itself publishing, from a listener): a record this
        engine writes meanwhile may be stamped before the entry, and refused as stale by other
        engines (a miss)."""
        if not keys:
            return
        order = 0
        for part in _entries(keys):
            trim = max(int((time.time() - self._config.retention) * 1000), 0)
            entry_id = await self._call(self._client.eval(
                _APPEND, 2, self.stream, self.horizon_key, f"{trim}-0", self.origin,
                msgpack.packb(part, use_bin_type=True)))
            order = entry_order(entry_id)
            self._tomb(part, order)
        self._counters["invalidations_published"] += 1
        if not read_back:
            return
        try:
            with stall_aware_timeout(self._config.timeout):
                async with self._advanced:
                    await self._advanced.wait_for(lambda: self.cursor >= order)
        except TimeoutError:
            log.warning("the shared tier's invalidation log did not come back within %gs",
                        self._config.timeout)

    def tombed_since(self, key: bytes, order: int) -> bool:
        """Whether an entry at or after `order` invalidated `key`."""
        return self.tombs.get(key, -1) >= order

    def stale(self, stamp: int, keys: Sequence[bytes]) -> bool:
        """Whether a record stamped `stamp` whose key and ancestors are `keys` predates an
        invalidation of any of them, or the log's horizon."""
        if stamp < self.horizon:
            return True
        tombs = self.tombs
        return any(tombs.get(key, -1) > stamp for key in keys)

    def _tomb(self, keys: Sequence[bytes], order: int) -> None:
        for key in keys:
            if self.tombs.get(key, -1) < order:
                self.tombs[key] = order

    # -- following ---------------------------------------------------------------------------
    async def _follow(self) -> None:
        backoff = 0.05
        loop = asyncio.get_running_loop()
        surveyed = loop.time()
        while not self._stopping:
            try:
                if not self.connected:
                    await self._read_horizon()
                    self.connected = True
                    self._counters["log_reconnects"] += 1
                    log.info("the shared tier's invalidation log is reachable again")
                await self._read_page(block=True)
                backoff = 0.05
                if loop.time() - surveyed >= SURVEY_EVERY:
                    # a log lost under a live connection (FLUSHALL, evicted) fails no read: a
                    # read from the cursor blocks, or goes on in the new log, as if nothing had
                    # been invalidated meanwhile; the survey finds the cursor's entry gone
                    surveyed = loop.time()
                    await self._read_horizon()
            except DeviceError as exc:
                if self.connected:
                    log.warning("the shared tier's invalidation log is unreachable: %s", exc)
                self.connected = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
            except Exception:  # a defect: say so, keep following
                log.exception("following the shared tier's invalidation log failed")
                await asyncio.sleep(_MAX_BACKOFF)

    async def _read_page(self, *, block: bool) -> bool:
        """Apply the next entries after the cursor; whether there were any."""
        wait = max(int(self._config.timeout * 500), 1) if block else None
        answer = await self._follow_call(self._follower.xread(
            {self.stream: _entry_id(self.cursor)}, count=_PAGE, block=wait))
        entries = answer.get(self.stream, [[]])[0] if isinstance(answer, dict) else (
            answer[0][1] if answer else [])
        for entry_id, fields in entries:
            await self._apply(entry_order(entry_id), fields)
        if len(self.tombs) >= self._prune_at:
            await self._prune()
        return bool(entries)

    async def _prune(self) -> None:
        """Learn the log's horizon now, and drop the tombs at or below it: `stale` refuses
        every record stamped before the horizon, and no tomb at or below it is after the
        stamp of any other."""
        await self._read_horizon()
        horizon = self.horizon
        self.tombs = {key: order for key, order in self.tombs.items() if order > horizon}
        self._prune_at = max(2 * len(self.tombs), PRUNE_AT)

    async def _apply(self, order: int, fields: dict[bytes, bytes]) -> None:
        try:
            keys = msgpack.unpackb(fields[b"k"], raw=True, use_list=True)
            if not isinstance(keys, list) or not all(isinstance(k, bytes) for k in keys):
                raise ValueError("not a list of keys")
        except (KeyError, ValueError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as exc:
            log.warning("skipping a malformed entry of the invalidation log: %s", exc)
            keys = []
        self._tomb(keys, order)
        if keys and fields.get(b"o") != self.origin:
            self._counters["invalidations_received"] += 1
            self._counters["keys_invalidated_remotely"] += len(keys)
            if self._listener is not None:
                await self._listener(keys, order)
        async with self._advanced:
            self.cursor = max(self.cursor, order)
            self._advanced.notify_all()

    async def reaches(self, cursor: int, epoch: bytes | None) -> bool:
        """Whether the log still holds everything after `cursor`, a position read in the log
        of `epoch` (None: not known, an older engine's save): see the module."""
        return _reaches(cursor, epoch, await self._survey(cursor))

    async def _survey(self, cursor: int) -> tuple[bytes, int, bool]:
        """The log's epoch, its horizon and whether `cursor`'s entry is in it (`_SURVEY`)."""
        epoch, trimmed, found = await self._call(self._client.eval(
            _SURVEY, 3, self.stream, self.epoch_key, self.horizon_key, os.urandom(8),
            _entry_id(cursor)))
        try:
            return bytes(epoch), entry_order(trimmed) if trimmed else 0, bool(found)
        except ValueError:  # not `ms-seq`: a key of something else under the prefix
            raise DeviceError(f"the shared tier's {self.horizon_key.decode(errors='replace')!r} "
                              f"holds {trimmed!r:.60}, not a tierkv log position: a "
                              "key of something else under key_prefix?") from None

    async def _read_horizon(self) -> None:
        """Learn what was trimmed, and whether the log is still the one this engine read; if
        entries it had not read are gone, or the whole log, it cannot know what they
        invalidated: the lost listener clears what it holds, and the follower reads on from
        what the log holds now."""
        survey = await self._survey(self.cursor)
        epoch, horizon, _found = survey
        lost = not _reaches(self.cursor, self.epoch or None, survey)
        # not trimmed past the cursor: the log itself was lost or rolled back, and with it
        # entries this engine read (its tombs above the horizon, which the log may lack now)
        rolled_back = lost and (epoch != self.epoch or horizon < self.cursor)
        told = [key for key, order in self.tombs.items() if order > horizon] \
            if rolled_back else []
        self.epoch = epoch
        self.horizon = max(self.horizon, horizon)
        if lost:
            self._counters["log_history_lost"] += 1
            log.warning("invalidations this engine had not read are gone from the shared "
                        "log (trimmed, or the log itself lost or rolled back): dropping the "
                        "objects it holds%s", f", publishing {len(told)} invalidations again"
                        if told else "")
            if self._lost is not None:
                await self._lost(told)
            async with self._advanced:
                # trimmed: on from the horizon; a lost log: from what the new one holds
                self.cursor = horizon
                self._advanced.notify_all()

    def stats(self) -> dict[str, Any]:
        return {**self._counters, "log_connected": self.connected, "log_cursor": self.cursor,
                "log_horizon": self.horizon, "tombs": len(self.tombs)}
