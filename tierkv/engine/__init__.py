"""The engine: public API, index ownership, pins, and execution of moves between tiers."""

from tierkv.engine.engine import Engine
from tierkv.engine.opener import EngineOpening, open
from tierkv.engine.pins import PinHandle

__all__ = ["Engine", "EngineOpening", "PinHandle", "open"]
