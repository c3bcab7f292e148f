"""`put`'s `latency_slo` argument, checked: the seconds a read of the object may take."""

from __future__ import annotations

import math
import numbers


def slo_seconds(latency_slo: object) -> float:
    """`put`'s `latency_slo` as seconds: `TypeError` for what is not a real number (a bool is
    not one, though Python counts it as an int), `ValueError` for one that is not positive and
    finite (an int too large for a float included)."""
    if isinstance(latency_slo, bool) or not isinstance(latency_slo, numbers.Real):
        raise TypeError(f"latency_slo is a number of seconds, not a {type(latency_slo).__name__}")
    try:
        seconds = float(latency_slo)
    except OverflowError:  # math.isfinite would raise it too, for an int beyond a float
        seconds = math.inf
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"latency_slo must be a positive, finite number of seconds, not "
                         f"{latency_slo!r:.40}")
    return seconds
