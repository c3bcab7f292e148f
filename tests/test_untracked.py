"""`tierkv._untracked.untrack`, through the extension module and through its ctypes fallback
(the path where the extension was not built, e.g. another interpreter version)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tierkv import _untracked


@dataclass(slots=True)
class _Record:
    key: bytes
    count: int


def _paths() -> list[Callable[[object], None]]:
    fallback = _untracked._ctypes_untrack()
    assert fallback is not None  # CPython
    return [_untracked.untrack, fallback]


@pytest.mark.parametrize("untrack", _paths(), ids=["default", "ctypes"])
def test_untrack_takes_a_record_out_of_sight_and_leaves_atoms_alone(
        untrack: Callable[[object], None]) -> None:
    record = _Record(b"k", 1)
    assert gc.is_tracked(record)
    untrack(record)
    assert not gc.is_tracked(record)
    untrack(record)  # twice is harmless
    for atom in (7, "text", b"bytes", 1.5, None):  # no collector header: must not be touched
        untrack(atom)
    record.count += 1  # still an ordinary object, freed by reference counting
    assert record == _Record(b"k", 2)


def test_the_extension_module_is_built() -> None:
    # scripts/setup builds it (setup.py); without it every record costs a ctypes call
    from tierkv._native import _untrack

    assert _untracked.untrack is _untrack.untrack
