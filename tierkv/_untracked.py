"""Per-object records the cyclic garbage collector need not walk.

Every full collection walks every object the collector tracks, on the event loop: with about
6.5 records per cached object (index entry, meta, its list of locations, the scheduler's score
and lineage node, the tier's record), a cache of 200,000 objects made each one 245 to 285 ms
long, a million about a second (docs/architecture.md, "Python's garbage collector"). CPython
untracks only exact tuples on its own; instances of classes stay tracked for life.

`untrack` takes a record out of the collector's sight (`PyObject_GC_UnTrack`, the call the
interpreter itself makes in every dealloc). Only ever for a record that can never be part of a
reference cycle: one whose fields hold only atoms (bytes, str, numbers, enum members), tuples of
them, or other such records — never a callback, a task, a tensor, a container of records or a
back-reference. Reference counting frees it as before; the collector only stops looking into
it, which is safe because anything it refers to counts as referenced from outside (kept), and
is what a cycle through it would leak — hence the rule. Where the interpreter is not CPython it
does nothing. The call is `tierkv/_native/untrack.c`'s, or the same through ctypes.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable

__all__ = ["MECHANISM", "untrack"]


def _ctypes_untrack() -> Callable[[object], None] | None:
    """The same C call through ctypes (about 0.3 µs, not 0.05), where the extension module was
    not built (no C compiler or Python headers when the package was installed)."""
    if sys.implementation.name != "cpython":  # pragma: no cover - the project runs on CPython
        return None
    function = ctypes.pythonapi.PyObject_GC_UnTrack
    function.argtypes = [ctypes.py_object]
    function.restype = None

    def untrack(record: object) -> None:
        # the C call reads the collector's header, which an object of a type without
        # collector support (an int, a str) does not have
        if gc.is_tracked(record):
            function(record)

    return untrack


def _noop(record: object) -> None:  # pragma: no cover - the project runs on CPython
    pass


try:
    from tierkv._native._untrack import untrack as _untrack

    #: how `untrack` is done here, for `tierkv info`
    MECHANISM = "native (tierkv/_native/untrack.c)"
except ImportError:  # pragma: no cover - built by scripts/setup
    _untrack = _ctypes_untrack() or _noop
    MECHANISM = ("ctypes (the extension module is not built: about 0.3 µs a record)"
                 if _untrack is not _noop else "off (not CPython)")

#: Stop the collector from walking a record (see the module for the rule it must meet).
untrack: Callable[[object], None] = _untrack
