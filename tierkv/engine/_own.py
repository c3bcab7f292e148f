"""Objects the engine keeps for itself in its persistent tiers, beside the cache's.

The fleet cursor, the tombstones of refused deletes, the edges into keys whose objects left
(`_departed`) and the invalidations the shared tier's server has not taken are each one object
under an engine key (`keys.is_engine_key`: no public
key encodes to one, and the index never lists them). Recovery records where each was found
(`EngineState.own`: key → tiers); `read_own` reads every copy there is, `keep_own` writes the
new one and deletes the older ones. Every call goes through the tier's guard, as the cache's own
calls do.

Each record is kept in `OWN_COPIES` persistent tiers where the hierarchy has that many: it is
small, written only at a flush, and one copy rotting on its media (a flipped bit, a torn write
the device acknowledged) must not undo it. With one copy, a damaged record of refused deletes
was dropped at open and the objects deleted while a device refused them came back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from tierkv.engine._state import EngineState, log
from tierkv.errors import CorruptObjectError, DeviceError, TierKVError
from tierkv.formats.value import ObjectMeta, encode_value, payload_view

T = TypeVar("T")


async def read_own(state: EngineState, key: bytes) -> list[tuple[ObjectMeta, memoryview]]:
    """Every readable copy of the engine's object `key` (meta, payload); a copy that is gone
    or whose tier fails is skipped, the failure logged."""
    found: list[tuple[ObjectMeta, memoryview]] = []
    for tier in state.own.get(key, []):
        try:
            got = await state.guards[tier].read(state.tiers[tier].get, key)
        except DeviceError as exc:
            log.warning("tier %s: the engine's record %r is unreadable: %s",
                        state.names[tier], key[1:].decode(errors="replace"), str(exc))
            continue
        if got is not None:
            found.append((got[0], payload_view(got[1])))
    return found


async def read_records(state: EngineState, key: bytes, decode: Callable[[memoryview], T],
                       unreadable: str) -> list[T]:
    """Every copy of the engine's record `key` that `decode` reads; a copy it refuses as
    corrupt is skipped with a warning: `unreadable`, then the reason."""
    records: list[T] = []
    for _meta, payload in await read_own(state, key):
        try:
            records.append(decode(payload))
        except CorruptObjectError as exc:
            log.warning("%s: %s", unreadable, str(exc))
    return records


#: persistent tiers that keep a copy of each of the engine's records, where there are that many
OWN_COPIES = 2


def own_tiers(state: EngineState) -> list[int]:
    """The tiers that may keep the engine's records: the local persistent ones, those whose
    breakers are closed first (the others are tried too: a flush records what it must, or
    fails)."""
    usable = state.scheduler.usable
    local = [tier for tier, device in enumerate(state.tiers)
             if device.persistent and not device.shared]
    return sorted(local, key=lambda tier: not usable[tier])


async def keep_own(state: EngineState, key: bytes, data: bytes | None,
                   tiers: Sequence[int] = (), *, copies: int = OWN_COPIES) -> list[int]:
    """Write `data` as the engine's object `key` into the first `copies` of `tiers` that
    take it (`data` None: keep none), then delete its older copies; the tiers written. The
    writes are made whatever the tiers' breakers say (a flush or a close writes these records,
    and must not pass over a healed tier still in its cool-down). If no tier takes it, the
    first failure is raised and nothing changed; an older copy whose delete fails stays listed
    in `own` (logged): it is read again at the next open, where the newest copy wins."""
    held = list(state.own.get(key, []))
    written: list[int] = []
    if data is not None:
        meta, payload = encode_value(data)
        meta = meta.with_generation(state.index.new_entry(key, meta).generation)
        failure: TierKVError | None = None
        for tier in tiers:
            try:
                await state.guards[tier].insist(state.tiers[tier].put, key, meta, payload)
            except TierKVError as exc:
                log.warning("tier %s: a copy of the engine's record %r was not written: %s",
                            state.names[tier], key[1:].decode(errors="replace"), str(exc))
                failure = failure or exc
                continue
            written.append(tier)
            if len(written) == copies:
                break
        if not written:
            raise failure or DeviceError("no persistent tier to keep the engine's record in")
    held = written + [other for other in held if other not in written]
    for older in [other for other in held if other not in written]:
        try:
            await state.guards[older].delete(state.tiers[older].delete, key)
        except TierKVError as exc:
            log.warning("tier %s: an older copy of the engine's record %r stays: %s",
                        state.names[older], key[1:].decode(errors="replace"), str(exc))
        else:
            held.remove(older)
    if held:
        state.own[key] = held
    else:
        state.own.pop(key, None)
    return written
