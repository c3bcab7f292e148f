"""Files a command must not read whole: one without line ends that never ends, one of 4 GiB,
and a child process that fails with MemoryError before it could take the machine's memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: the kinds of unbounded input (`endless_input`)
KINDS = ["dev-zero", "sparse-pool"]


def endless_input(tmp_path: Path, kind: str) -> Path:
    """/dev/zero, or a sparse 4 GiB file named like a pool (a path tab completion offers)."""
    if kind == "dev-zero":
        return Path("/dev/zero")
    path = tmp_path / "tierkv.pool"
    with path.open("wb") as pool:
        pool.truncate(4 << 30)
    return path


def _address_space_capped() -> None:
    # a child that reads without bound fails here with MemoryError instead of taking the
    # machine's memory
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def run_capped(*args: str) -> subprocess.CompletedProcess[str]:
    """`tierkv ARGS` in a child whose address space is capped at 3 GiB."""
    return subprocess.run(
        [sys.executable, "-m", "tierkv.cli", *args],
        capture_output=True, text=True, timeout=120, check=False,
        preexec_fn=_address_space_capped,
    )
