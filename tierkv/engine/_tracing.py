"""OpenTelemetry spans of the engine's calls and background moves; nothing without an SDK.

The tracer is chosen once, when the engine is made: from the `tracer_provider` given to
`tierkv.open`, else from the global provider (`opentelemetry.trace.get_tracer_provider()`), as
``get_tracer("tierkv")``. While that provider is the API's stand-in (no SDK installed: a
`ProxyTracerProvider`) or a `NoOpTracerProvider`, the engine makes no spans at all and each call
pays one attribute test, so an application installs its SDK before it opens the engine.

Spans (kind INTERNAL):

- one per public call, current while it runs (so a tier's own instrumentation, the redis
  client's, nests under it): ``tierkv.get``, ``tierkv.get_many``, ``tierkv.put``,
  ``tierkv.put_many`` (its puts are its children), ``tierkv.delete``, ``tierkv.invalidate``,
  ``tierkv.invalidate_model``, ``tierkv.flush``;
- one per background move: ``tierkv.promote``, ``tierkv.demote``, ``tierkv.share``,
  ``tierkv.evict``, ``tierkv.drop``. A move planned inside a traced call (a get's promotion, a
  prefetch that followed its chain, a put's share) is a *child* of that call's span, in its
  trace, though it runs after the call returned (its parent is captured when the plan is
  submitted); a move the evictors or the expiry planned starts a trace of its own.

Attributes, never key bytes: ``tierkv.key.kind`` (block, bytes, str), ``tierkv.key.hash`` (8 hex
digits of a BLAKE2b hash of the canonical key: enough to tell one key's spans from another's,
nothing to recover the key from), ``tierkv.hit`` and ``tierkv.tier`` (the tier that served a
get, or took a put), ``tierkv.bytes`` (payload bytes), ``tierkv.keys`` and ``tierkv.hits`` (a
get_many), ``tierkv.removed`` (invalidations), ``tierkv.deleted``; on moves ``tierkv.source``,
``tierkv.target`` (tier names), ``tierkv.background`` and ``tierkv.moved`` (False: the plan
was discarded, the object having changed or been busy). An exception leaving a call or a move is
recorded on its span, which is then marked as an error; a call cancelled (its caller gave up)
carries ``tierkv.cancelled`` (true), its status left unset: the engine did not fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterator
from contextvars import ContextVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer, TracerProvider

from tierkv.scheduler import Demote, Drop, Evict, Plan, Promote, Share

#: the span of the tierkv call running in this task (what a move submitted now descends from)
_CALL: ContextVar[Span | None] = ContextVar("tierkv_call", default=None)

GET, GET_MANY, PUT, PUT_MANY = "tierkv.get", "tierkv.get_many", "tierkv.put", "tierkv.put_many"
DELETE, INVALIDATE, INVALIDATE_MODEL, FLUSH = (
    "tierkv.delete", "tierkv.invalidate", "tierkv.invalidate_model", "tierkv.flush")
_MOVES: dict[type[Plan], str] = {Promote: "tierkv.promote", Demote: "tierkv.demote",
                                 Share: "tierkv.share", Evict: "tierkv.evict",
                                 Drop: "tierkv.drop"}
_KINDS = {0x01: "block", 0x02: "bytes", 0x03: "str"}


def tracer_for(provider: TracerProvider | None) -> Tracer | None:
    """The tracer of `provider` (None: the global one), or None where spans would go nowhere."""
    chosen = trace.get_tracer_provider() if provider is None else provider
    if isinstance(chosen, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    tracer = trace.get_tracer("tierkv", tracer_provider=chosen)
    # an SDK switched off (OTEL_SDK_DISABLED) hands out no-op tracers
    return None if isinstance(tracer, trace.NoOpTracer) else tracer


def key_attributes(raw: bytes) -> dict[str, str]:
    return {"tierkv.key.kind": _KINDS.get(raw[0], "other") if raw else "other",
            "tierkv.key.hash": hashlib.blake2b(raw, digest_size=4).hexdigest()}


def traced_get(span: Span, tier: str | None, nbytes: int) -> None:
    """A get's outcome on its span: served by `tier` (None: a miss), `nbytes` payload bytes."""
    if tier is None:
        span.set_attribute("tierkv.hit", False)
    else:
        span.set_attributes({"tierkv.hit": True, "tierkv.tier": tier, "tierkv.bytes": nbytes})


def current_call() -> Span | None:
    """The span of the traced tierkv call this task is in, if any (captured at submit)."""
    return _CALL.get()


class Tracing:
    """The engine's spans (made only where a real tracer exists: `tracer_for`)."""

    __slots__ = ("_names", "_tracer")

    def __init__(self, tracer: Tracer, names: tuple[str, ...]) -> None:
        self._tracer = tracer
        self._names = names

    @contextlib.contextmanager
    def call(self, name: str, raw: bytes | None = None) -> Iterator[Span]:
        """The span of one public call, current (and the parent of the moves it submits) until
        the block ends. `raw`: the canonical key the call is about."""
        attributes = key_attributes(raw) if raw is not None else None
        with self._tracer.start_as_current_span(name, attributes=attributes) as span:
            token = _CALL.set(span)
            try:
                yield span
            except asyncio.CancelledError:
                # OpenTelemetry records an `Exception` only: a cancelled call's span ended
                # with nothing to tell it from one that returned
                span.set_attribute("tierkv.cancelled", True)
                raise
            finally:
                _CALL.reset(token)

    @contextlib.contextmanager
    def move(self, plan: Plan, background: bool, parent: Span | None) -> Iterator[Span]:
        """The span of one background move; a child of `parent` (the call that planned it),
        else a root. The worker task's own context (inherited when the engine opened) is never
        its parent."""
        context = Context() if parent is None else trace.set_span_in_context(parent, Context())
        attributes: dict[str, str | int | bool] = {
            **key_attributes(plan.key), "tierkv.bytes": plan.nbytes,
            "tierkv.background": background}
        if isinstance(plan, Evict | Drop):
            attributes["tierkv.source"] = self._names[plan.tier]
        else:
            attributes["tierkv.source"] = self._names[plan.source]
            attributes["tierkv.target"] = self._names[plan.target]
        with self._tracer.start_as_current_span(_MOVES[type(plan)], context=context,
                                                attributes=attributes) as span:
            yield span
