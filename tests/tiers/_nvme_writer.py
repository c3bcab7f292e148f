"""Writer process for the crash and fault tests (run as a script, not collected by pytest).

``crash DIR BACKEND``: puts objects in batches, flushes after each batch and prints
``FLUSHED i j ...`` for the batch, then sleeps until killed.
``lru DIR BACKEND SEED``: LRU eviction over few small regions; a seeded random mix of puts
(new versions of a few keys), deletes and reads (mostly of a few keys written first, which
keeps the oldest region the most recently used), printing each op
``PUT i n`` / ``DEL i`` before doing it, the keys a put dropped (``DROP i ...``) and ``ACK``
after each flush; runs until killed.
``fsize DIR BACKEND LIMIT``: lowers RLIMIT_FSIZE to LIMIT bytes (writes past it fail with EFBIG,
a real error from the kernel's write path), puts until a region write fails and prints
``DEVICE_ERROR <errno>`` when flush raises `DeviceError`.
``supersede DIR BACKEND CASE``: a region write fails after the region got a tombstone and an
overwrite of keys flushed in an older region (see `supersede`).
"""

from __future__ import annotations

import asyncio
import random
import resource
import signal
import sys
from pathlib import Path

from tests.tiers._nvme_support import (
    BLOCK,
    REGION,
    entry_bytes,
    key,
    meta_of,
    nvme_config,
    payload_for,
    per_region,
)
from tierkv.config import NvmeBackend, RegionEviction
from tierkv.errors import DeviceError
from tierkv.formats.nvme_layout import SUPERBLOCK_SIZE
from tierkv.tiers.nvme.tier import NvmeTier


async def crash(directory: Path, backend: NvmeBackend) -> None:
    tier = NvmeTier(nvme_config(directory, regions=16, backend=backend))
    await tier.open()
    i = 0
    for _batch in range(40):
        done = []
        for _ in range(5):
            data = payload_for(i, 1000 + 97 * i % 20000)
            await tier.put(key(i), meta_of(data), memoryview(data))
            done.append(i)
            i += 1
        await tier.flush()
        print("FLUSHED", *done, flush=True)
    print("DONE", flush=True)
    await asyncio.sleep(3600)


def versioned(i: int, version: int) -> bytes:
    """Payload of version `version` of key `i`: its first 8 digits are ``i * 10000 + version``."""
    return payload_for(i * 10000 + version, 20000 + 7919 * (i + version) % 60000)


def key_id(raw: bytes) -> int:
    return int(raw.rsplit(b"-", 1)[1])


async def lru(directory: Path, backend: NvmeBackend, seed: int) -> None:
    rng = random.Random(seed)
    tier = NvmeTier(nvme_config(directory, regions=6, backend=backend, reinsert_hits=0,
                                eviction=RegionEviction.LRU))
    await tier.open()
    versions: dict[int, int] = {}

    async def put(i: int) -> None:
        versions[i] = versions.get(i, 0) + 1
        data = versioned(i, versions[i])
        print("PUT", i, i * 10000 + versions[i], flush=True)
        dropped = await tier.put(key(i), meta_of(data), memoryview(data))
        if dropped:
            print("DROP", *(key_id(k) for k in dropped), flush=True)

    # keys 0..5 are written once, with the first versions of the others, and then read often:
    # their region stays the most recently used while the newer regions get reclaimed first
    for i in range(40):
        await put(i)
    while True:
        for _ in range(10):
            i, roll = rng.randrange(6, 40), rng.random()
            if roll < 0.45:
                await put(i)
            elif roll < 0.6:
                print("DEL", i, flush=True)
                await tier.delete(key(i))
            else:
                await tier.get(key(rng.randrange(6)) if roll < 0.9 else key(i))
        await tier.flush()
        print("ACK", flush=True)


async def fsize(directory: Path, backend: NvmeBackend, limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    tier = NvmeTier(nvme_config(directory, backend=backend))
    await tier.open()
    try:
        for i in range(600):
            data = payload_for(i, 5000)
            await tier.put(key(i), meta_of(data), memoryview(data))
        await tier.flush()
    except DeviceError as exc:
        print("DEVICE_ERROR", getattr(exc, "errno", 0), flush=True)
    else:
        print("NO_ERROR", flush=True)
    first = await tier.get(key(0))
    print("FIRST", "hit" if first is not None else "miss", flush=True)
    await tier.close()


#: the keys of the supersede scenario: a deleted one and an overwritten one, both first written
#: (and flushed) in region 1, which stays on media
DELETED, OVERWRITTEN = 1000, 1001
NEW_VALUE = b"the new value" * 100
#: 5000-byte entries (packed: 5120 bytes) that fill a region exactly
PER = per_region(5000)
#: the entries of region 1 besides `DELETED` and `OVERWRITTEN`
REGION_1 = range(PER, 2 * PER - 2)
#: the log's regions in the supersede scenario: four for data, one kept for the checkpoint
SUPERSEDE_REGIONS = 5


async def supersede(directory: Path, backend: NvmeBackend, case: str) -> None:
    """Five 1 MiB regions (`SUPERSEDE_REGIONS`: one stays free for the checkpoint, region 4, as
    the log keeps one); writes to regions 3 and 4 fail (RLIMIT_FSIZE, EFBIG). Regions 0-2 are
    filled and flushed, `DELETED` and `OVERWRITTEN` in region 1; region 3, the head, then gets the
    tombstone of `DELETED` and the new version of `OVERWRITTEN`. ``sealed``: region 3 is filled,
    its write fails, a reclaim takes region 0 for the head; a flush raises, prints
    ``FLUSH_FAILED <errno>`` and the writer waits to be killed. ``close``: the tier is closed
    with region 3 still the head (its write fails at close's flush); prints ``CLOSED``.
    """
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = SUPERBLOCK_SIZE + 3 * REGION
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    tier = NvmeTier(nvme_config(directory, regions=SUPERSEDE_REGIONS, backend=backend,
                                reinsert_hits=0))
    await tier.open()

    async def put(i: int, data: bytes) -> None:
        await tier.put(key(i), meta_of(data), memoryview(data))

    # `PER` entries fill a region to its last byte: region 0 takes entries 0 to PER - 1, region 1
    # the two keys and `REGION_1`, region 2 the next `PER`, so that the tombstone opens region 3
    assert PER * entry_bytes(0, 5000) == REGION - BLOCK
    for i in range(PER):
        await put(i, payload_for(i, 5000))
    for i in (DELETED, OVERWRITTEN):
        await put(i, payload_for(i, 5000))
    for i in range(PER, 3 * PER - 2):
        await put(i, payload_for(i, 5000))
    await tier.flush()  # regions 0-2 on media
    assert tier.stats()["regions_free"] == 2
    assert await tier.delete(key(DELETED))
    await put(OVERWRITTEN, NEW_VALUE)
    assert tier.stats()["regions_free"] == 1  # region 3 is the head, region 4 kept free
    if case == "close":
        await tier.close()
        print("CLOSED", flush=True)
        return
    for i in range(1010, 1010 + PER):  # fill region 3: it is sealed and written
        await put(i, payload_for(i, 5000))
    try:
        await tier.flush()
    except DeviceError as exc:
        print("FLUSH_FAILED", getattr(exc, "errno", 0), flush=True)
    else:
        print("NO_ERROR", flush=True)
    await asyncio.sleep(3600)


def main() -> None:
    mode, directory, backend = sys.argv[1], Path(sys.argv[2]), NvmeBackend(sys.argv[3])
    if mode == "crash":
        asyncio.run(crash(directory, backend))
    elif mode == "lru":
        asyncio.run(lru(directory, backend, int(sys.argv[4])))
    elif mode == "supersede":
        asyncio.run(supersede(directory, backend, sys.argv[4]))
    else:
        asyncio.run(fsize(directory, backend, int(sys.argv[4])))


if __name__ == "__main__":
    main()
