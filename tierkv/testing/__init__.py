"""Test support shipped with tierkv: the conformance suite every tier's tests subclass."""

from tierkv.testing.conformance import TierConformance, payload_bytes

__all__ = ["TierConformance", "payload_bytes"]
