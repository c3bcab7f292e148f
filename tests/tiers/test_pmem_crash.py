"""Crash consistency: a writer process is SIGKILLed at random points, again and again.

A "zygote" subprocess imports tierkv once and forks one writer per round (so a round costs
milliseconds, not an interpreter start). The writer applies a random sequence of puts (sizes on
both sides of the off-loop threshold) and deletes to one pool, logging ``B <op>`` before and ``A``
after each operation to a file (a `write` survives the kill). After the kill, this process opens
the pool and checks that the recovered store equals the state after the last acknowledged
operation, or after the one in flight, with every payload exact and nothing freed as corrupt.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.config import PmemTierConfig
from tierkv.tiers.pmem.tier import PmemTier

pytestmark = [pytest.mark.pmem, pytest.mark.crash]

CAPACITY = 32 << 20
ROUNDS = 24

ZYGOTE = textwrap.dedent("""
    import asyncio, os, random, sys
    from pathlib import Path
    from tierkv.config import PmemTierConfig
    from tierkv.formats.value import ObjectMeta, ValueKind
    from tierkv.tiers.pmem.tier import PmemTier

    SIZES = (0, 100, 4000, 70_000, 300_000)

    def payload(key, generation, size):
        return random.Random(f"{key}/{generation}").randbytes(size)

    async def writer(seed, pool, log_path, capacity):
        rng = random.Random(seed)
        with open(log_path, "w", buffering=1) as log:
            tier = PmemTier(PmemTierConfig("pmem", capacity, Path(pool)))
            await tier.open()
            log.write("R\\n")
            for index in range(100_000):
                key = f"k{rng.randrange(16)}"
                if rng.random() < 0.25:
                    log.write(f"B del {key}\\n")
                    await tier.delete(key.encode())
                else:
                    generation = seed * 1_000_000 + index
                    size = rng.choice(SIZES)
                    data = payload(key, generation, size)
                    log.write(f"B put {key} {generation} {size}\\n")
                    meta = ObjectMeta(ValueKind.BYTES, "", (), size, generation)
                    await tier.put(key.encode(), meta, memoryview(data))
                log.write("A\\n")

    for line in sys.stdin:
        seed, pool, log_path, capacity = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                asyncio.run(writer(int(seed), pool, log_path, int(capacity)))
            finally:
                os._exit(0)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(status, flush=True)
""")

State = dict[str, tuple[int, int]]  # key -> (generation, size)


def expected_payload(key: str, generation: int, size: int) -> bytes:
    return random.Random(f"{key}/{generation}").randbytes(size)


def replay(state: State, log_text: str) -> tuple[State, State]:
    """The state after the acknowledged operations, and after the one in flight too."""
    acked = dict(state)
    pending = dict(state)
    for line in log_text.splitlines():
        parts = line.split()
        if not parts or parts[0] == "R":
            continue
        if parts[0] == "A":
            acked = dict(pending)
        elif parts[1] == "del":
            pending = dict(acked)
            pending.pop(parts[2], None)
        else:
            pending = dict(acked)
            pending[parts[2]] = (int(parts[3]), int(parts[4]))
    return acked, pending


async def recovered_state(pool: Path) -> tuple[State, int]:
    tier = PmemTier(PmemTierConfig("pmem", CAPACITY, pool))
    recovered = await tier.open()
    try:
        state: State = {}
        for item in recovered:
            got = await tier.get(item.key)
            assert got is not None, "a recovered object failed its checksum"
            key = item.key.decode()
            meta, data = got
            assert bytes(data) == expected_payload(key, meta.generation, meta.nbytes), "torn"
            state[key] = (meta.generation, meta.nbytes)
        corrupt = int(tier.stats()["corrupt_freed_at_open"])
        assert tier.used <= tier.capacity
        return state, corrupt
    finally:
        await tier.close()


@pytest.fixture
def pool_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"tierkv-crash-{uuid.uuid4().hex}.pool"
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".creating").unlink(missing_ok=True)  # killed mid-creation


@pytest.fixture
def zygote() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_sigkill_never_tears_objects(pool_path: Path, zygote: subprocess.Popen[str],
                                     tmp_path: Path) -> None:
    assert zygote.stdin is not None and zygote.stdout is not None
    rng = random.Random(20240611)
    state: State = {}
    acknowledged = 0
    for round_ in range(1, ROUNDS + 1):
        log_path = tmp_path / f"round-{round_}.log"
        zygote.stdin.write(f"{round_} {pool_path} {log_path} {CAPACITY}\n")
        zygote.stdin.flush()
        pid = int(zygote.stdout.readline())
        time.sleep(rng.uniform(0.01, 0.35))
        os.kill(pid, signal.SIGKILL)
        status = int(zygote.stdout.readline())
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        text = log_path.read_text() if log_path.exists() else ""
        acked, pending = replay(state, text)
        acknowledged += text.count("\nA") + text.startswith("A")
        got, corrupt = asyncio.run(recovered_state(pool_path))
        assert corrupt == 0
        assert got in (acked, pending), f"round {round_}: recovered state is neither"
        state = got
    assert acknowledged > ROUNDS, "the writer should get some operations done between kills"
