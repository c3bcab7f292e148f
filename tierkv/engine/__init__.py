"""The engine: public API, index ownership, pins, and execution of moves between tiers."""

from tierkv.engine._pins import PinHandle
from tierkv.engine.engine import Engine
from tierkv.engine.opener import EngineOpening, open

__all__ = ["Engine", "EngineOpening", "PinHandle", "open"]
