"""What a pmem pool is mapped on: the filesystem, DAX, and what that means for durability.

Separate from the tier because it reads only the mount table and the pool file's header, never
opens the pool: `probe` (for `tierkv info`) uses it before a tier exists, the tier after open.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tierkv.config import PmemTierConfig
from tierkv.errors import DeviceError
from tierkv.formats import pmem_layout as layout
from tierkv.tiers._native import library_path
from tierkv.tiers.pmem import _pmemobj as pmemobj


@dataclass(frozen=True, slots=True)
class Media:
    """What the pool is mapped on, and what that means for durability."""

    is_pmem: bool
    filesystem: str
    tmpfs: bool

    @property
    def emulated(self) -> bool:
        return not self.is_pmem

    @property
    def durability(self) -> str:
        if self.is_pmem:
            return ("real persistent memory: an object is durable once put returns (CPU cache "
                    "flushes), across process crashes and power loss where the platform "
                    "flushes its caches on power failure (ADR/eADR)")
        if self.tmpfs:
            return ("emulated on tmpfs (RAM): the pool survives a process crash, NOT a reboot "
                    "or power loss")
        return (f"emulated on an ordinary {self.filesystem} file: persisted by msync (slow); "
                "survives a process crash; power-loss safety is only what msync writeback "
                "of this filesystem gives, not persistent memory")


def filesystem_of(path: Path) -> tuple[str, str]:
    """(type, mount options) of the mount holding `path` (or its nearest existing ancestor)."""
    target = path
    while not target.exists():
        target = target.parent
    resolved = os.path.realpath(target)
    best_point, fstype, options = "", "unknown", ""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return fstype, options
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or not tail:
            continue
        point = fields[4].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best_point):
            best_point, fstype = point, tail[0]
            options = fields[5] + ("," + tail[2] if len(tail) > 2 else "")
    return fstype, options


def is_dax(fstype: str, options: str, path: Path) -> bool:
    if path.exists() and not path.is_file() and path.name.startswith("dax"):
        return True
    return any(opt in ("dax", "dax=always") for opt in options.split(","))



def probe(config: PmemTierConfig) -> dict[str, str]:
    """What `tierkv info` can say about a pmem tier without creating or touching its pool."""
    info: dict[str, str] = {"path": str(config.path)}
    try:
        pmemobj.library()
        info["library"] = f"{pmemobj.LIBPMEMOBJ} and {pmemobj.LIBPMEM} loaded"
    except DeviceError as exc:
        info["library"] = str(exc)
    native = library_path()
    info["copies"] = (f"native ({native.name})" if native is not None
                      else "python (the native copy library is not built; scripts/setup builds it)")
    found = layout.inspect_pool(config.path)
    if found.kind in (layout.PoolFile.ABSENT, layout.PoolFile.EMPTY):
        info["pool"] = (f"{found.kind.value}; open creates "
                        f"{layout.pool_size_for(config.capacity)} bytes for capacity "
                        f"{config.capacity}")
    else:
        info["pool"] = f"{found.kind.value}" + (f", {found.size} bytes" if found.size else "")
        expected = layout.pool_size_for(config.capacity)
        if found.kind is layout.PoolFile.TIERKV and found.size < expected:
            # the header alone does not say how large the pool was made: a pool cut short
            # (a copy that stopped, a full filesystem) looks whole here; open walks it
            info["pool"] += (f" (capacity {config.capacity} makes {expected} bytes: made for "
                             "a smaller capacity, or truncated; open checks it)")
    fstype, options = filesystem_of(config.path)
    dax = is_dax(fstype, options, config.path)
    info["filesystem"] = fstype + (" mounted with dax" if dax else "")
    if fstype == "tmpfs":
        info["mapping"] = ("emulated (tmpfs is RAM, not persistent memory): survives a process "
                           "crash, not a reboot")
    elif dax:
        info["mapping"] = "DAX: real persistent memory is confirmed by pmem_is_pmem at open"
    else:
        info["mapping"] = (f"emulated ({fstype} without DAX, persisted by msync); "
                           "pmem_is_pmem is known only once the pool is open")
    return info
