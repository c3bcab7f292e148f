"""A failed region write never brings back what that region had superseded, after a crash.

The region holding a tombstone and an overwrite of keys flushed in an older region fails to be
written (a real EFBIG: the writer process runs under a lowered RLIMIT_FSIZE that only that region
and the one the log keeps free for its checkpoint lie beyond). Its records never reach the media
while the older region's do; the tier must tombstone those keys again elsewhere. Two cases: the
region fails as a sealed region (the writer is then killed with SIGKILL, no checkpoint), and it
fails as the head at `close()` (whose checkpoint cannot be written either). Either way the next
open scans, and the deleted key must stay deleted and the overwritten key must be absent or new,
never old.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers._nvme_support import key, nvme_config, payload_for
from tests.tiers._nvme_writer import (
    DELETED,
    NEW_VALUE,
    OVERWRITTEN,
    REGION_1,
    SUPERSEDE_REGIONS,
)
from tierkv.config import NvmeBackend
from tierkv.testing import payload_bytes
from tierkv.tiers.nvme.tier import NvmeTier

ROOT = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("_nvme_writer.py")
BACKENDS = [pytest.param(NvmeBackend.IO_URING, marks=pytest.mark.uring), NvmeBackend.THREADS]


def _run_writer(directory: Path, backend: NvmeBackend, case: str) -> list[str]:
    """The writer's output lines; in the ``sealed`` case it is killed after its failed flush."""
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), "supersede", str(directory), backend.value, case],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for raw in proc.stdout:
            lines.append(raw.decode().strip())
            if case == "sealed" and lines[-1].startswith(("FLUSH_FAILED", "NO_ERROR")):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        _out, err = proc.communicate(timeout=60)
    expected = -signal.SIGKILL if case == "sealed" else 0
    assert proc.returncode == expected, err.decode()
    return lines


@pytest.mark.crash
@pytest.mark.parametrize("case", ["sealed", "close"])
@pytest.mark.parametrize("backend", BACKENDS, ids=["uring", "threads"])
async def test_failed_write_never_resurrects_superseded(
    tmp_path: Path, backend: NvmeBackend, case: str
) -> None:
    setup = NvmeTier(nvme_config(tmp_path, regions=SUPERSEDE_REGIONS, backend=backend))
    await setup.open()  # formats the file at its full size before the writer's limit applies
    await setup.close()

    lines = _run_writer(tmp_path, backend, case)
    assert (f"FLUSH_FAILED {errno.EFBIG}" if case == "sealed" else "CLOSED") in lines

    tier = NvmeTier(nvme_config(tmp_path, regions=SUPERSEDE_REGIONS, backend=backend,
                                reinsert_hits=0))
    recovered = await tier.open()
    try:
        assert tier.stats()["recovered_from"] == "scan"
        found = {r.key for r in recovered}
        # the older region (`REGION_1` beside the two keys) is still on media: the old records
        # were there to come back
        assert {key(i) for i in REGION_1} <= found
        assert key(DELETED) not in found
        assert await tier.get(key(DELETED)) is None
        got = await tier.get(key(OVERWRITTEN))
        if key(OVERWRITTEN) in found:
            assert got is not None and payload_bytes(got[1]) == NEW_VALUE
        else:
            assert got is None
        for r in recovered:
            i = int(r.key.rsplit(b"-", 1)[1])
            if i != OVERWRITTEN:
                entry = await tier.get(r.key)
                assert entry is not None
                assert payload_bytes(entry[1]) == payload_for(i, 5000)
    finally:
        await tier.close()
