"""The shared Tier conformance suite.

Every tier's tests subclass `TierConformance` and implement `make_tier`, which builds an *unopened*
tier whose media lives under the given directory (calling it twice with the same directory must
address the same media, so persistent tiers can be reopened). The suite then checks the contract
of `tierkv.tiers.base.Tier` through the public tier API.

Media hooks. A persistent tier's subclass also implements `crash_image` and `corrupt_payload`,
which reach its media directly (the bytes `tierkv.formats` defines), bypassing the tier under
test, as zarr's store tests do with their backends: the suite uses them to open a tier on the
media as a kill -9 leaves it, and to damage one object on the media. Tests of what a tier lacks
(persistence, for a volatile tier; running out of space, for a tier that `reclaims_space`) skip
themselves with a reason.
"""

from __future__ import annotations

from tierkv.testing._data_cases import DataPathCases
from tierkv.testing._persistence_cases import PersistenceCases
from tierkv.testing._space_cases import SpaceCases
from tierkv.testing._support import payload_bytes

__all__ = ["TierConformance", "payload_bytes"]


class TierConformance(DataPathCases, SpaceCases, PersistenceCases):
    """Behaviour every tier shares; subclass it and implement `make_tier` (and, for a persistent
    tier, the media hooks `crash_image` and `corrupt_payload`): the case groups' tests run
    against it."""
