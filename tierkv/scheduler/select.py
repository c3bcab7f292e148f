"""`select_tier`: the slowest tier that meets an object's latency SLO at its access frequency.

The rule it generalises — "accessed more than 1000 times a second with an SLO under 500 ns: the
persistent-memory tier, else NVMe" — to N tiers, each described by a measured (or configured)
`TierProfile`. A tier *meets* an object when one access takes at most the SLO
(``latency + nbytes / bandwidth``) and the object's accesses would keep at most
`MAX_UTILISATION` of the tier's service capacity (``frequency * access_time`` of its
`queue_depth` parallel slots) busy: one hot object must not saturate a device that could serve
each access in time. Among the tiers that meet it, the slowest one with room wins, so fast
tiers are kept for the objects that need them; when none meets it, the fastest with room does
(the best the hierarchy can do). Pure: no IO, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: the share of a tier's parallel service time one object's accesses may take
MAX_UTILISATION = 0.5


@dataclass(frozen=True, slots=True)
class TierProfile:
    """How fast a tier serves one read: `latency` seconds plus `nbytes / bandwidth`."""

    latency: float
    bandwidth: float
    queue_depth: int = 1

    def access_time(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def meets(self, nbytes: int, slo: float, frequency: float) -> bool:
        seconds = self.access_time(nbytes)
        return seconds <= slo and frequency * seconds <= MAX_UTILISATION * self.queue_depth


def select_tier(profiles: Sequence[TierProfile], nbytes: int, slo: float, frequency: float,
                room: Sequence[bool]) -> int | None:
    """The index of the tier for an object of `nbytes` read `frequency` times a second under a
    latency `slo` (seconds); `room[i]`: tier i can take it now. ``None`` if no tier has room."""
    meeting = [i for i, profile in enumerate(profiles)
               if room[i] and profile.meets(nbytes, slo, frequency)]
    if meeting:
        return max(meeting, key=lambda i: profiles[i].access_time(nbytes))
    with_room = [i for i in range(len(profiles)) if room[i]]
    if not with_room:
        return None
    return min(with_room, key=lambda i: profiles[i].access_time(nbytes))
