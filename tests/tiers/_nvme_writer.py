"""Writer process for the crash and fault tests (run as a script, not collected by pytest).

``crash DIR BACKEND``: puts objects in batches, flushes after each batch and prints
``FLUSHED i j ...`` for the batch, then sleeps until killed.
``fsize DIR BACKEND LIMIT``: lowers RLIMIT_FSIZE to LIMIT bytes (writes past it fail with EFBIG,
a real error from the kernel's write path), puts until a region write fails and prints
``DEVICE_ERROR <errno>`` when flush raises `DeviceError`.
"""

from __future__ import annotations

import asyncio
import resource
import signal
import sys
from pathlib import Path

from tests.tiers._nvme_support import key, meta_of, nvme_config, payload_for
from tierkv.config import NvmeBackend
from tierkv.errors import DeviceError
from tierkv.tiers.nvme import NvmeTier


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


def main() -> None:
    mode, directory, backend = sys.argv[1], Path(sys.argv[2]), NvmeBackend(sys.argv[3])
    if mode == "crash":
        asyncio.run(crash(directory, backend))
    else:
        asyncio.run(fsize(directory, backend, int(sys.argv[4])))


if __name__ == "__main__":
    main()
