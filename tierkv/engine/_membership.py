"""Media that sat out a session of its hierarchy: refused at open, or cleared with ``format``.

An engine run without one of its persistent tiers (taken out of the config for a while) goes on
overwriting and deleting keys that tier still holds. Back in the hierarchy, its older values
won by generation (numbered from what the tiers present at each open held) and its deleted keys
came back. So each local persistent tier keeps, as an object of the engine's own
(`MEMBERSHIP_KEY`, `formats.membership`), its id and the last session it took part in: that
session's number and id, and the ids of the tiers it opened with. At open, before anything a
tier recovered is indexed (indexing settles two copies of a key by generation, and would
delete the newer one):

- the latest session is the highest number any record holds (of two sessions with the same
  number, each run without the other's tier: one whose tier the other lists as a member, as it
  ran later from that tier's older record, else the first tier's in the hierarchy's order);
- a tier is current if its record names that session, or the session opened with it (its
  record is older and it is among that session's members: a crash cut short the writing of
  the records, or its write failed; one of the same number as the latest is another session,
  run alone from that older record), or it holds nothing;
- any other tier sat that session out (or ran before records were kept, beside one that has
  one): with ``format = false`` the open is refused with a `DeviceError` naming it and how to
  clear it; with ``format = true`` everything it holds is deleted and synced first;
- where no tier has a record but several hold objects (each ran alone, and a lone persistent
  tier keeps none), the first that holds any is taken and the others are refused or cleared
  the same way: their copies, numbered per tier, cannot be ordered;
- so is a tier whose record is damaged (it failed its checksum, whether the tier found it so
  at open, `Tier.damaged_at_open`, or at the read here), with a refusal that says so: its id
  was in that record, so the others' records cannot vouch for it.

Then every local persistent tier gets this session's record, synced. Records are kept only
where they can matter: where two local persistent tiers are present, or a tier has one already
(it was in such a hierarchy, and a session without the others must be recorded). A hierarchy
of one persistent tier that never had another writes none. A tier that does not take its
record at once (a pool reopened smaller, over its capacity until objects move out) gets it
once the evictors run, or at a later flush or the close (`insist_on_records`).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.config import NvmeTierConfig, PmemTierConfig
from tierkv.engine._state import EngineState, log
from tierkv.errors import CorruptObjectError, DeviceError, TierFullError, TierKVError
from tierkv.formats.membership import ID_SIZE, Membership, decode_membership, encode_membership
from tierkv.formats.value import encode_value, payload_view
from tierkv.keys import MEMBERSHIP_KEY
from tierkv.tiers.base import RecoveredObject

#: what a record takes in a tier, about (a waiter for room asks for this much)
RECORD_BYTES = 256


@dataclass(slots=True)
class _Found:
    """A local persistent tier at open: its index, its record (None: none or unreadable), and
    whether it holds anything."""

    tier: int
    record: Membership | None
    holds: bool
    damaged: bool = False
    #: the tier taken instead, where neither has a record (`settle_membership`)
    unordered: str = ""


async def settle_membership(state: EngineState, recovered: list[list[RecoveredObject]]
                            ) -> dict[int, Membership]:
    """Check the local persistent tiers' records against each other (the module docstring):
    refuse a tier that sat a session out, or clear it (``format = true``; its entry of
    `recovered` emptied). The records of the tiers kept, by tier; `DeviceError` naming the
    first refused tier."""
    found = [await _read(state, tier, recovered[tier]) for tier in _local(state)]
    records = [each.record for each in found if each.record is not None]
    latest = _latest(records)
    # no record anywhere, yet several tiers hold objects: each ran alone (a lone persistent
    # tier keeps no record), and their copies, numbered per tier, cannot be ordered; the first
    # is taken (settled by generation, a tier's older values won over the other's newer ones)
    first_holder = next((each.tier for each in found if each.holds and not each.damaged), None)
    kept: dict[int, Membership] = {}
    for each in found:
        if latest is None and each.holds and not each.damaged and each.tier != first_holder:
            each.unordered = state.names[first_holder] if first_holder is not None else ""
        elif _current(each, latest):
            if each.record is not None:
                kept[each.tier] = each.record
            continue
        name, config = state.names[each.tier], state.config.tiers[each.tier]
        assert isinstance(config, PmemTierConfig | NvmeTierConfig)
        why = _why(each)
        if not config.format:
            # a damaged record may have been the only one of a session run with this tier
            # alone: then the others sat it out, and no record left says so
            also = ("; if the hierarchy ran with it but without the others since they last ran "
                    "together, clear those too (only its record knew)" if each.damaged else "")
            raise DeviceError(
                f"tier {name!r} ({config.path}): {why}; refused, nothing it holds deleted. "
                f"`tierkv format --config FILE --tier {name} --yes` clears it (what it holds "
                f"is lost; the other tiers keep theirs), or set format = true for that tier"
                f"{also}")
        log.warning("tier %s (%s): %s; cleared (format = true)", name, config.path, why)
        await _clear(state, each.tier, recovered[each.tier])
        recovered[each.tier] = []
    return kept


async def record_membership(state: EngineState, kept: dict[int, Membership]
                            ) -> dict[int, Membership]:
    """Write this session's record into every local persistent tier and sync it, where records
    are kept (the module docstring); `kept`: what `settle_membership` returned. Returns the
    records a tier did not take (logged), for `insist_on_records` once the evictors run."""
    local = _local(state)
    if len(local) < 2 and not kept:
        return {}
    members = {tier: kept[tier].tier if tier in kept else os.urandom(ID_SIZE) for tier in local}
    seq = max((record.seq for record in kept.values()), default=0) + 1
    session = os.urandom(ID_SIZE)
    failed: dict[int, Membership] = {}
    records = {tier: Membership(members[tier], seq, session, frozenset(members.values()))
               for tier in local}
    state.record_dropped[MEMBERSHIP_KEY] = functools.partial(_dropped, state, records)
    for tier, record in records.items():
        try:
            await _write(state, tier, record)
        except TierKVError as exc:
            log.warning("tier %s: this session's membership record was not written (tried "
                        "again once objects can move out): %s", state.names[tier], str(exc))
            failed[tier] = record
    return failed


async def insist_on_records(state: EngineState, failed: dict[int, Membership]) -> None:
    """Write the records `record_membership` could not, now that the evictors run (a pool
    reopened with a smaller capacity holds more than it may until they move objects out),
    waiting for room up to `space_timeout`. Where the one local persistent tier takes none,
    the open fails with a `DeviceError`: nothing would say the session ran, and the tiers that
    sat it out would be taken after it. Otherwise a tier that still refuses keeps its record
    pending (`_pending`), and the open goes on: a device that fails writes for a while must not
    make a cache that reads fine unopenable."""
    loop = asyncio.get_running_loop()
    refused: dict[int, TierKVError] = {}
    for tier, record in failed.items():
        space = state.spaces[tier]
        deadline = loop.time() + space.timeout
        while True:
            try:
                await _write(state, tier, record)
                break
            except TierFullError as exc:
                try:
                    room = await space.wait_for_room(RECORD_BYTES, deadline)
                except TierFullError:
                    room = False
                if not room:
                    refused[tier] = exc
                    break
            except TierKVError as exc:
                refused[tier] = exc
                break
    if refused and len(refused) == len(_local(state)) == 1:
        first, why = next(iter(refused.items()))
        raise DeviceError(f"no persistent tier took this session's membership record (tier "
                          f"{state.names[first]!r}: {why}): the open is refused, as what the "
                          "session deleted or overwrote could come back after it")
    for tier, why in refused.items():
        _pending(state, tier, failed[tier], why)


async def write_unrecorded(state: EngineState) -> None:
    """Try the pending membership records again (a flush, the close)."""
    for tier, record in list(state.unrecorded.items()):
        try:
            await _write(state, tier, record)
        except TierKVError as exc:
            log.warning("tier %s: this session's membership record is still not written: %s",
                        state.names[tier], str(exc))
        else:
            state.unrecorded.pop(tier, None)


def _pending(state: EngineState, tier: int, record: Membership, exc: TierKVError) -> None:
    """`tier` did not take `record`: kept to be tried again at each flush and at close. Until
    then the tier's older record stands, listed among this session's members by the others'
    records; a later session of that tier alone may take this session's number from it, which
    `_current` tells apart (a member's older record must be older than the latest session)."""
    log.warning("tier %s: this session's membership record could not be written (tried again "
                "at each flush and at close): %s", state.names[tier], str(exc))
    state.unrecorded[tier] = record


def _dropped(state: EngineState, records: dict[int, Membership], tier: int) -> None:
    """`tier` dropped an engine record on its own: this session's membership record is
    written again, in the background (close waits for it before it closes the tiers). Left
    dropped, the next open found the tier holding objects but no record, and refused it: a
    clean close, then a cache that would not open."""
    if tier in records:
        state.spawn(_write_again(state, tier, records[tier]))


async def _write_again(state: EngineState, tier: int, record: Membership) -> None:
    try:
        if not await state.tiers[tier].contains(MEMBERSHIP_KEY):  # not written since
            await _write(state, tier, record)
    except TierKVError as exc:
        _pending(state, tier, record, exc)


async def _write(state: EngineState, tier: int, record: Membership) -> None:
    """`record` into `tier`, synced; the tier is then one that holds the engine's record."""
    meta, payload = encode_value(encode_membership(record))
    meta = meta.with_generation(state.index.new_entry(MEMBERSHIP_KEY, meta).generation)
    device, guard = state.tiers[tier], state.guards[tier]
    await guard.insist(device.put, MEMBERSHIP_KEY, meta, payload)
    await guard.settle(device.flush)
    if tier not in state.own.setdefault(MEMBERSHIP_KEY, []):
        state.own[MEMBERSHIP_KEY].append(tier)


def _latest(records: list[Membership]) -> Membership | None:
    """The latest session: the highest number; of two with it, one whose tier the other lists
    as a member ran after it (numbered from that tier's older record, its write in the other
    failed), else the first tier's in the hierarchy's order."""
    top = max((record.seq for record in records), default=None)
    tied = [record for record in records if record.seq == top]
    return next((record for record in tied
                 if any(record.tier in other.members and other.session != record.session
                        for other in tied)), tied[0] if tied else None)


def _local(state: EngineState) -> list[int]:
    return [tier for tier, device in enumerate(state.tiers)
            if device.persistent and not device.shared]


def _current(found: _Found, latest: Membership | None) -> bool:
    if found.damaged:
        return False
    if latest is None or not found.holds:
        return True
    record = found.record
    # a member whose own record is older: its write in the latest session failed, or a crash cut
    # the writing of the records short; one of the same number is another session, run alone
    # from that older record, which the latest one's tiers sat out
    return record is not None and (record.session == latest.session
                                   or (record.tier in latest.members
                                       and record.seq < latest.seq))


def _why(found: _Found) -> str:
    """Why a tier is not current, as the refusal says it."""
    if found.damaged:
        # Not rewritten from the other tiers' records: they list the ids of the latest
        # session's members, but this tier's own id was in the damaged record, so nothing
        # tells it from a tier that sat that session out (another pool, say, took its place
        # meanwhile; or the bytes that failed were the session's)
        return ("its record of the sessions it took part in is damaged (it failed its "
                "checksum), so nothing tells whether the hierarchy ran without it since: what "
                "it holds may have been overwritten or deleted meanwhile")
    if found.unordered:
        return (f"it and tier {found.unordered!r} both hold objects and neither has a record of "
                "the sessions it took part in: each ran without the other, and nothing tells "
                "which holds the newer values")
    if found.record is None:
        return ("it holds objects but no record of the sessions it took part in, which the "
                "other tiers have: the hierarchy ran without it since it last took part, it "
                "ran before such records were kept, or its record was lost to damage at an "
                "earlier open; what it holds may have been overwritten or deleted meanwhile")
    return ("the hierarchy ran without it since it last took part: what it holds may have "
            "been overwritten or deleted meanwhile")


async def _read(state: EngineState, tier: int, recovered: Sequence[RecoveredObject]) -> _Found:
    holds = any(obj.key != MEMBERSHIP_KEY for obj in recovered)
    # a record the tier found damaged at open is not among what it recovered: without its
    # report that would read as a tier that never had one
    if MEMBERSHIP_KEY in state.tiers[tier].damaged_at_open():
        return _Found(tier, None, holds, damaged=True)
    try:
        return _Found(tier, await _record_of(state, tier, recovered), holds)
    except CorruptObjectError:
        return _Found(tier, None, holds, damaged=True)


async def _record_of(state: EngineState, tier: int, recovered: Sequence[RecoveredObject]
                     ) -> Membership | None:
    """The tier's record, None where it has none; `CorruptObjectError` where it cannot be
    read (a tier that recovered it and now misses it, or bytes that do not decode)."""
    if not any(obj.key == MEMBERSHIP_KEY for obj in recovered):
        return None
    try:
        got = await state.guards[tier].read(state.tiers[tier].get, MEMBERSHIP_KEY)
    except DeviceError as exc:
        raise CorruptObjectError(f"membership record unreadable: {exc}") from exc
    if got is None:
        raise CorruptObjectError("membership record recovered, then missing")
    return decode_membership(payload_view(got[1]))


async def _clear(state: EngineState, tier: int, recovered: Sequence[RecoveredObject]) -> None:
    """Delete everything `tier` recovered, and sync the deletes before any record says the
    tier is current."""
    device, guard = state.tiers[tier], state.guards[tier]
    for obj in recovered:
        await guard.insist(device.delete, obj.key)
    await guard.settle(device.flush)
