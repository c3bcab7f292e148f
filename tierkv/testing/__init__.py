"""Test support shipped with tierkv: the conformance suite every tier's tests subclass, and
a way to cancel an operation at each of its awaits in turn."""

from tierkv.testing.conformance import TierConformance, payload_bytes
from tierkv.testing.stepping import Stepped, cancel_at

__all__ = ["Stepped", "TierConformance", "cancel_at", "payload_bytes"]
