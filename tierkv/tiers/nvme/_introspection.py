"""What the NVMe tier reports about itself: `stats`, `describe`, and `probe` before it exists.

Separate from the tier because it only reads: the counters and gauges of the log's state, the
device and backend an open tier uses (`tierkv info`), and, for a tier not opened, what the
machine offers at its path (`probe`: io_uring, O_DIRECT, and what its superblock says the next
open will do: recover, format or refuse), which reads the tier file's first block and writes
nothing. Nothing here changes the state or waits on the device.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from tierkv._platform import io_uring_available, o_direct_supported
from tierkv._units import format_size
from tierkv.config import NvmeTierConfig
from tierkv.errors import CorruptObjectError
from tierkv.formats.nvme_layout import (
    SUPERBLOCK_SIZE,
    BlankSuperblockError,
    ForeignFormatError,
    OlderLayoutError,
    decode_superblock,
    format_uuid,
)
from tierkv.tiers.base import TierState
from tierkv.tiers.nvme._device import lock_holder
from tierkv.tiers.nvme._regions import RegionState
from tierkv.tiers.nvme._state import LogState


def log_stats(st: LogState) -> dict[str, Any]:
    """The log's part of `NvmeTier.stats`: its counters, then the backend's and regions' gauges."""
    states = [r.state for r in st.regions]
    return {
        **st.counters,
        "backend": st.io.name if st.io is not None else None,
        "sq_poll": getattr(st.io, "sq_poll", None),
        "eagain_retries": getattr(st.io, "eagain_retries", 0),
        "regions_used": sum(s is not RegionState.FREE for s in states),
        "regions_free": st.regions.count - sum(s is not RegionState.FREE for s in states),
        # regions with bookkeeping in DRAM: those touched so far, not the capacity
        "regions_in_memory": st.regions.made,
        # kept FREE for the checkpoint (left out of `capacity`)
        "regions_reserved": st.reserve.held,
        "entries": len(st.index),
        "buffer_bytes_mapped": st.pool.mapped,
        "recovered_from": st.recovered_from,
    }


def describe_log(st: LogState, capacity: int, state: TierState) -> dict[str, str]:
    """`NvmeTier.describe`: the configured log, and once open its device and backend."""
    config = st.config
    device = st.device
    info = {
        "path": str(config.path),
        "capacity": str(capacity),
        "region_size": str(config.region_size),
        "regions": str(st.region_count),
        "eviction": config.eviction.value,
    }
    if device is None:
        info["state"] = state.value
        return info
    info.update({
        "device": "block device" if device.block_device else "regular file",
        "io": "direct (O_DIRECT)" if device.direct else "buffered (page cache)",
        "backend": st.io.name if st.io is not None else "closed",
        "logical_block_size": (str(device.logical_block_size)
                               if device.logical_block_size else "unknown (4096 assumed)"),
        "alignment": str(device.alignment),
        "queue_depth": str(config.queue_depth),
    })
    sq_poll = getattr(st.io, "sq_poll", None)
    if sq_poll is not None:
        info["sq_poll"] = f"kernel submission polling, idle after {sq_poll * 1000:g}ms"
    if st.sb is not None:
        info["uuid"] = format_uuid(st.sb.uuid)
    return info


def probe(config: NvmeTierConfig) -> dict[str, str]:
    """What this machine offers the tier at `config.path`, without touching the tier's file.

    O_DIRECT is tried on a temporary file beside the path (or read-only on a block device).
    """
    reason = io_uring_available()
    return {
        "io_uring": "available" if reason is None else f"unavailable: {reason}",
        "o_direct": ("supported" if o_direct_supported(config.path)
                     else "refused (use direct = false)"),
        "backend": config.backend.value,
        "sq_poll": ("off" if config.sq_poll is None
                    else f"on, idle after {config.sq_poll * 1000:g}ms"),
        "path_exists": "yes" if config.path.exists() else "no (created at open)",
        "log": _log_on_media(config),
    }


def _log_on_media(config: NvmeTierConfig) -> str:
    """What the next open would find at `config.path`, from its superblock (read, never
    written): a log it recovers, new media it formats, or what it refuses and why."""
    try:
        with open(config.path, "rb") as media:
            head = media.read(SUPERBLOCK_SIZE)
    except FileNotFoundError:
        return "none yet (created at open)"
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    if not head:
        return "none yet (an empty file: formatted at open)"
    refused = "; the next open refuses it (format = true overwrites it, losing what it holds)"
    try:
        sb = decode_superblock(head)
    except BlankSuperblockError:
        if stat.S_ISBLK(os.stat(config.path).st_mode):
            return "a zeroed superblock: a new device, formatted at open"
        return "a zeroed superblock" + refused
    except (OlderLayoutError, ForeignFormatError) as exc:
        return f"no tierkv log of this version ({exc})" + refused
    except CorruptObjectError as exc:
        return f"a damaged tierkv superblock ({exc})" + refused
    count = (config.capacity - SUPERBLOCK_SIZE) // config.region_size
    found = f"{sb.region_count} regions of {format_size(sb.region_size)}"
    if (sb.region_count, sb.region_size) != (count, config.region_size):
        return (f"a tierkv log of {found}; the config asks for {count} regions of "
                f"{format_size(config.region_size)}" + refused)
    log = f"a tierkv log of {found} (uuid {format_uuid(sb.uuid)})"
    holder = lock_holder(config.path)
    if holder is not None:
        return f"{log}: in use ({holder}); an open is refused until that engine closes it"
    return f"{log}: recovered at open"
