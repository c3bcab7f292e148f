"""The probe process of `_probe`: what the tier's open does with PMDK, in a process of its own.

Run as a script (``python -I -S _probe_child.py POOL LAYOUT ROOT_SIZE LIBRARY PARENT_PID``), never
imported:
it uses the standard library only, so that it starts in milliseconds without the tierkv package
(whose import costs a second), and it is told the layout name, root size and library name by its
parent instead of importing them from `tierkv.formats`.

It makes the calls the tier's open makes on media it has not yet trusted: ``pmemobj_open`` (lane
recovery, heap boot), ``pmemobj_root`` and a read of the root record, then the recovery walk
(``pmemobj_first``/``pmemobj_next`` with each object's type and usable size), and checks that
every object the walk returns lies inside the pool and after the one before it (PMDK walks the
heap forwards, so an offset that does not grow is damage, and a walk that could loop forever
ends). Damage PMDK does not detect crashes this process, which is the point.

Output, one JSON object a line on stdout: ``{"walked": n}`` at most once a second as the walk
goes, then one verdict: ``{"opened": n}``, ``{"refused": errno, "message": ...}`` (PMDK returned
an error: its errno and ``pmemobj_errormsg``) or ``{"damaged": ...}``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import sys
import time

_HEARTBEAT = 1.0  # seconds between progress lines during the walk
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class _Oid(ctypes.Structure):
    _fields_ = (("pool_uuid_lo", ctypes.c_uint64), ("off", ctypes.c_uint64))


def _say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _bind(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(name, use_errno=True)
    c = ctypes
    for function, restype, argtypes in (
        ("pmemobj_open", c.c_void_p, [c.c_char_p, c.c_char_p]),
        ("pmemobj_close", None, [c.c_void_p]),
        ("pmemobj_root", _Oid, [c.c_void_p, c.c_size_t]),
        ("pmemobj_direct", c.c_void_p, [_Oid]),
        ("pmemobj_first", _Oid, [c.c_void_p]),
        ("pmemobj_next", _Oid, [_Oid]),
        ("pmemobj_type_num", c.c_uint64, [_Oid]),
        ("pmemobj_alloc_usable_size", c.c_size_t, [_Oid]),
        ("pmemobj_errormsg", c.c_char_p, []),
    ):
        bound = getattr(lib, function)
        bound.restype = restype
        bound.argtypes = argtypes
    return lib


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when the thread that started it ends, and end now if
    that already happened. Why: PMDK holds the pool's ``flock`` while the probe has it open, and a
    probe that outlived its parent (killed with SIGKILL during its open) kept it for as long as its
    walk took, so the restarted process's open was refused with "pool is in use"."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None or prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not Linux: the probe then outlives a killed parent by the rest of its run
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def _mapped_size(path: str) -> int | None:
    """Bytes PMDK maps: the file's size, a block device's; ``None`` for anything else (a device
    DAX, whose size only sysfs tells), and then extents go unchecked."""
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if not stat.S_ISBLK(st.st_mode):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END) or None
    finally:
        os.close(fd)


def _refused(lib: ctypes.CDLL) -> None:
    code = ctypes.get_errno()
    raw = lib.pmemobj_errormsg()
    _say(refused=code, message=raw.decode(errors="replace") if raw else "")


def _walk(lib: ctypes.CDLL, pop: int, size: int | None, root_size: int) -> None:
    end = None if size is None else pop + size

    def inside(address: int, length: int) -> bool:
        return address >= pop and (end is None or address + length <= end)

    root = lib.pmemobj_root(pop, root_size)
    # no root (PMDK could not allocate one): the tier's own call fails the same way, cleanly
    if root.off:
        address = lib.pmemobj_direct(root) or 0
        if not inside(address, root_size):
            _say(damaged=f"the root object at offset {root.off:#x} lies outside the pool")
            return
        ctypes.string_at(address, root_size)  # what the tier's root check reads
    count = 0
    previous = 0
    beat = time.monotonic()
    oid = lib.pmemobj_first(pop)
    while oid.off:
        if oid.off <= previous:
            _say(damaged=f"the heap walk went back from offset {previous:#x} to {oid.off:#x}")
            return
        lib.pmemobj_type_num(oid)
        address = lib.pmemobj_direct(oid) or 0
        usable = lib.pmemobj_alloc_usable_size(oid)
        if not inside(address, usable):
            _say(damaged=f"the object at offset {oid.off:#x} ({usable} bytes) extends past the "
                         "pool")
            return
        count += 1
        previous = oid.off
        if time.monotonic() - beat >= _HEARTBEAT:
            _say(walked=count)
            beat = time.monotonic()
        oid = lib.pmemobj_next(oid)
    _say(opened=count)


def main(argv: list[str]) -> None:
    path, layout, root_size, library, parent = argv
    _die_with(int(parent))
    lib = _bind(library)
    size = _mapped_size(path)
    pop = lib.pmemobj_open(os.fsencode(path), layout.encode())
    if not pop:
        _refused(lib)
        return
    try:
        _walk(lib, pop, size, int(root_size))
    finally:
        lib.pmemobj_close(pop)


if __name__ == "__main__":
    main(sys.argv[1:])
