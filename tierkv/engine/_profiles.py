"""The tiers' access profiles for `select_tier`: configured, or measured by a short probe.

A tier whose `latency` and `bandwidth` are both set in its config keeps them. For the others
reads of 4 KiB and of 256 KiB are timed three times each: the fastest small read is the latency,
the large read beyond it gives the bandwidth. A tier that times its media itself does so
(`Tier.time_read`: the nvme log, whose newest entries a read finds in memory; one with nothing
that long written yet gets its kind's typical bandwidth); for the others a probe object of each
size is written, read back and deleted. The probe runs once, when the first put with a
`latency_slo` needs the profiles (so engines that never ask pay nothing, and no probe object ever
lands on media otherwise). A tier that cannot take the probe (full, failing) gets its kind's
typical profile. The probe keys carry a tag no public key encodes to, so they can never meet a
user's key. Its calls go through the tier's guard like every other call into a tier: a hung
device cuts them off (the probe fails), and a delete it refuses is kept to retry like any other.
"""

from __future__ import annotations

import time

from tierkv.config import TierKind
from tierkv.engine._state import EngineState, log
from tierkv.errors import DeviceError, TierKVError
from tierkv.formats.value import encode_value
from tierkv.keys import PROBE_PREFIX
from tierkv.scheduler.select import TierProfile

#: typical (latency seconds, bandwidth bytes/s) of each kind, when a probe cannot run
TYPICAL = {TierKind.GPU: (2e-6, 10e9), TierKind.PMEM: (1e-6, 4e9), TierKind.NVME: (100e-6, 2e9)}
_SMALL, _LARGE, _ROUNDS = 4096, 256 << 10, 3


async def measure_profiles(state: EngineState) -> tuple[TierProfile, ...]:
    profiles = []
    for index, (tier, config) in enumerate(zip(state.tiers, state.config.tiers, strict=True)):
        measured = TYPICAL[config.kind]
        if config.latency is None or config.bandwidth is None:
            measured = await _probe(state, index) or measured
        latency = config.latency if config.latency is not None else measured[0]
        bandwidth = float(config.bandwidth) if config.bandwidth is not None else measured[1]
        profiles.append(TierProfile(latency, bandwidth, tier.queue_depth))
        log.info("tier %s profile: %.3g s + bytes / %.3g B/s", tier.name, latency, bandwidth)
    return tuple(profiles)


async def _probe(state: EngineState, index: int) -> tuple[float, float] | None:
    tier = state.tiers[index]
    if not tier.can_ever_hold(_LARGE):
        return None
    try:
        small_time = await _media_read_time(state, index, _SMALL)
        if small_time is not None:
            large_time = await _media_read_time(state, index, _LARGE)
            if large_time is None:  # nothing written yet that a large read could time
                return small_time, TYPICAL[state.config.tiers[index].kind][1]
        else:
            small_time = await _object_read_time(state, index, _SMALL)
            large_time = await _object_read_time(state, index, _LARGE)
    except TierKVError as exc:
        log.warning("tier %s: the profile probe failed (%s); using typical figures",
                    tier.name, str(exc))
        return None
    if small_time is None or large_time is None:
        return None
    return small_time, (_LARGE - _SMALL) / max(large_time - small_time, 1e-9)


async def _media_read_time(state: EngineState, index: int, nbytes: int) -> float | None:
    """The fastest of a few reads of `nbytes` the tier timed on its media itself
    (`Tier.time_read`); ``None`` where it does not."""
    tier, guard = state.tiers[index], state.guards[index]
    best = None
    for _ in range(_ROUNDS):
        seconds = await guard.read(tier.time_read, nbytes)
        if seconds is None:
            return None
        best = seconds if best is None else min(best, seconds)
    return best


async def _object_read_time(state: EngineState, index: int, nbytes: int) -> float | None:
    """The fastest of a few reads of an `nbytes` probe object; ``None`` if it did not fit."""
    tier, guard = state.tiers[index], state.guards[index]
    key = PROBE_PREFIX + str(nbytes).encode()
    meta, payload = encode_value(bytes(nbytes))
    if not tier.reclaims_space and not tier.fits(meta.nbytes):
        return None
    await guard.write(tier.put, key, meta, payload)
    try:
        best = float("inf")
        for _ in range(_ROUNDS):
            started = time.perf_counter()
            if await guard.read(tier.get, key) is None:
                return None
            best = min(best, time.perf_counter() - started)
        return best
    finally:
        try:
            await guard.delete(tier.delete, key)
        except DeviceError:
            if state.refused_delete is not None:  # retried and recorded at the next flush
                state.refused_delete(key, index)
            raise
