"""Objects the engine keeps for itself in its persistent tiers, beside the cache's.

The fleet cursor, the tombstones of refused deletes and the invalidations the shared tier's
server has not taken are each one object under an engine key (`keys.is_engine_key`: no public
key encodes to one, and the index never lists them). Recovery records where each was found
(`EngineState.own`: key → tiers, more than one where deleting an older copy failed); `read_own`
reads every copy there is, `keep_own` writes a new one and deletes the older ones. Every call
goes through the tier's guard, as the cache's own calls do.
"""

from __future__ import annotations

from tierkv.engine._state import EngineState, log
from tierkv.errors import DeviceError, TierKVError
from tierkv.formats.value import ObjectMeta, encode_value, payload_view


async def read_own(state: EngineState, key: bytes) -> list[tuple[ObjectMeta, memoryview]]:
    """Every readable copy of the engine's object `key` (meta, payload); a copy that is gone
    or whose tier fails is skipped, the failure logged."""
    found: list[tuple[ObjectMeta, memoryview]] = []
    for tier in state.own.get(key, []):
        try:
            got = await state.guards[tier].read(state.tiers[tier].get, key)
        except DeviceError as exc:
            log.warning("tier %s: the engine's record %r is unreadable: %s",
                        state.names[tier], key[1:].decode(errors="replace"), exc)
            continue
        if got is not None:
            found.append((got[0], payload_view(got[1])))
    return found


async def keep_own(state: EngineState, key: bytes, data: bytes | None,
                   tier: int | None = None) -> None:
    """Write `data` as the engine's object `key` into `tier` (`data` None: keep none), then
    delete its older copies. The write is made whatever the tier's breaker says (a flush or a
    close writes these records, and must not pass over a healed tier still in its cool-down). A
    failed write raises and changes nothing; an older copy whose delete fails stays listed in
    `own` (logged): it is read again at the next open, where the newest copy wins."""
    held = list(state.own.get(key, []))
    if data is not None:
        assert tier is not None, "a copy is written into a tier"
        meta, payload = encode_value(data)
        meta = meta.with_generation(state.index.new_entry(key, meta).generation)
        await state.guards[tier].insist(state.tiers[tier].put, key, meta, payload)
        held = [tier, *(other for other in held if other != tier)]
    for older in [other for other in held if data is None or other != tier]:
        try:
            await state.guards[older].delete(state.tiers[older].delete, key)
        except TierKVError as exc:
            log.warning("tier %s: an older copy of the engine's record %r stays: %s",
                        state.names[older], key[1:].decode(errors="replace"), exc)
        else:
            held.remove(older)
    if held:
        state.own[key] = held
    else:
        state.own.pop(key, None)
