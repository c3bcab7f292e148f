"""The engine's miss-storm watch: every miss feeds a `MissStormDetector` with its key's prefix.

The detector (`tierkv.health.miss_storm`) has the `[health]` table's `entropy_alert_bits` and
`window`, is checked at most every 5 s, and runs on the engine's clock (the one `tierkv.open`
was given). The prefix of a missed key (`miss_prefix`) is the part of the key space it belongs
to, the canonical key's tag byte first so that kinds never mix:

- a `bytes` or `str` key: its first bytes up to the first ``/`` or ``:`` (the separator left
  out), at most `PREFIX_BYTES` of them: ``"tenant-7/doc/12"`` → ``tenant-7``;
- a `BlockKey`: its `model` ("name@revision", as `block_keys` was told), else its
  `rope_theta`. Not its tenant: the namespace is hashed into the digest, which cannot give it
  back, and the digest itself would make every block its own prefix.

A key space of one part cannot storm: an engine serving block keys of one model sees every miss
under one prefix, 0 bits, however healthy it is (a trace replay, a single-model server). So the
watch raises nothing until its misses have shown a second prefix (`watching`); from then on a
window of misses under one prefix is a storm like any other. Misses are counted either way.

An alert is logged by the detector, counted (`Engine.metrics().miss_storm`,
``tierkv_miss_storm_alerts_total``) and handed to the callback set with `Engine.on_miss_storm`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable

from tierkv.config import HealthConfig
from tierkv.health import MissStormAlert, MissStormDetector, MissStormSnapshot
from tierkv.keys import BlockKey, Key

log = logging.getLogger("tierkv.engine")

#: bytes of a bytes or str key's prefix, at most (the tag byte aside)
PREFIX_BYTES = 16
#: bytes of a model name in a block key's prefix, at most
MODEL_BYTES = 64
_THETA = struct.Struct("<d")

MissStormCallback = Callable[[MissStormAlert], None]


def miss_prefix(key: Key, raw: bytes) -> bytes:
    """The prefix of `key` (canonical form `raw`) that a miss of it is counted under."""
    if isinstance(key, BlockKey):
        if key.model is not None:
            return raw[:1] + key.model.encode("utf-8", "replace")[:MODEL_BYTES]
        return raw[:1] + _THETA.pack(float(key.rope_theta))
    body = raw[1:1 + PREFIX_BYTES]
    end = len(body)
    for separator in (b"/", b":"):
        found = body.find(separator, 0, end)
        if found >= 0:
            end = found
    return raw[:1] + body[:end]


class MissWatch:
    __slots__ = ("_clock", "_first", "callback", "detector", "threshold_bits", "watching")

    def __init__(self, health: HealthConfig, clock: Callable[[], float]) -> None:
        self._clock = clock
        #: called with each alert (`Engine.on_miss_storm`)
        self.callback: MissStormCallback | None = None
        #: the configured threshold; the detector's is 0 (no window is a storm) until watching
        self.threshold_bits = health.entropy_alert_bits
        self.detector = MissStormDetector.from_config(health, on_alert=self._alerted)
        self.detector.threshold_bits = 0.0
        #: misses have shown two prefixes at least (see the module); the first one's prefix
        self.watching = False
        self._first: bytes | None = None

    def missed(self, key: Key, raw: bytes) -> None:
        prefix = miss_prefix(key, raw)
        if not self.watching:
            if self._first is None:
                self._first = prefix
            elif prefix != self._first:
                self.watching = True
                self.detector.threshold_bits = self.threshold_bits
        self.detector.missed(prefix, self._clock())

    def check(self) -> None:
        """Let the detector see a storm end (or last) while misses are rare."""
        self.detector.check(self._clock())

    def snapshot(self) -> MissStormSnapshot:
        return self.detector.snapshot(self._clock())

    def _alerted(self, alert: MissStormAlert) -> None:
        callback = self.callback
        if callback is None:
            return
        try:
            callback(alert)
        except Exception:  # the application's defect must not fail the get that noticed
            log.exception("the miss-storm callback failed")
