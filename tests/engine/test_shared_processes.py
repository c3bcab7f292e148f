"""Two engine processes sharing a redis server (tests/engine/_shared_peer.py, one JSON command
per line): what one puts the other gets byte for byte; what one invalidates the other stops
serving, also when it was frozen (SIGSTOP) while the invalidation was published — its follower
reads the log on from where it stopped; and both live through the server being killed and
restarted under them.

Each process follows the fleet's log in the background and signals nothing: the tests ask
again until the effect shows (`eventually`, a few seconds at most)."""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.engine._configs import KiB, gpu_tier
from tierkv.testing.redis_server import RedisServer

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
SHARED = "shared"
#: seconds a peer may take to open (it imports torch) and to answer one command
START_TIMEOUT = 60.0
ANSWER_TIMEOUT = 10.0


def value_of(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest() * (20 + i)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Peer:
    """One engine process, started by the constructor (`wait_ready` waits for it to open);
    `ask` sends a command and returns its answer."""

    def __init__(self, config: dict[str, Any], stderr: IO[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.engine._shared_peer", json.dumps(config)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)

    def wait_ready(self) -> None:
        assert self._read(START_TIMEOUT) == {"ready": True}

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        stdin.flush()
        answer = self._read(ANSWER_TIMEOUT)
        assert "error" not in answer, answer
        return answer

    def put(self, key: str, value: bytes, parents: tuple[str, ...] = ()) -> None:
        self.ask("put", key=key, value=value.hex(), parents=list(parents))

    def get(self, key: str) -> str | None:
        digest: str | None = self.ask("get", key=key)["sha256"]
        return digest

    def get_many(self, keys: list[str]) -> list[str | None]:
        digests: list[str | None] = self.ask("get_many", keys=keys)["sha256"]
        return digests

    def stats(self) -> dict[str, Any]:
        return self.ask("stats", tier=SHARED)

    def close(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a test that failed while it was frozen
            try:
                self.ask("close")
                self.process.wait(timeout=ANSWER_TIMEOUT)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()

    def _read(self, timeout: float) -> dict[str, Any]:
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], timeout)
        assert ready, f"peer {self.process.pid} did not answer within {timeout} s"
        line = stdout.readline()
        assert line, f"peer {self.process.pid} exited ({self.process.poll()})"
        answer: dict[str, Any] = json.loads(line)
        return answer


def peer_config(url: str) -> dict[str, Any]:
    return {"tiers": [gpu_tier(capacity=1024 * KiB, slot_size=4 * KiB),
                      {"name": SHARED, "kind": "redis", "capacity": "16MiB", "url": url,
                       "timeout": "300ms"}]}


def eventually(condition: Callable[[], bool], within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


@pytest.fixture
def start_peers(tmp_path: Path) -> Iterator[Callable[[str], tuple[Peer, Peer]]]:
    """Starts engine processes A and B on a server's url (both at once: each imports torch;
    their stderr goes to files in tmp_path); closes them (SIGKILL if they do not answer)
    after the test."""
    peers: list[Peer] = []
    logs: list[IO[str]] = []

    def start(url: str) -> tuple[Peer, Peer]:
        for name in ("a", "b"):
            logs.append((tmp_path / f"{name}.stderr").open("w"))
            peers.append(Peer(peer_config(url), logs[-1]))
        for peer in peers:
            peer.wait_ready()
        return peers[0], peers[1]

    try:
        yield start
    finally:
        for peer in peers:
            peer.close()
        for log in logs:
            log.close()


def test_what_one_process_puts_the_other_gets_and_invalidates(
        redis_url: str, start_peers: Callable[[str], tuple[Peer, Peer]]) -> None:
    a, b = start_peers(redis_url)
    a.put("P", value_of(0))
    keys = [f"k{i}" for i in range(1, 9)]
    for i, key in enumerate(keys, 1):
        a.put(key, value_of(i), parents=("P",))
    a.ask("settle")
    assert b.get("P") == sha(value_of(0))
    assert b.get_many(keys) == [sha(value_of(i)) for i in range(1, 9)]
    b.ask("settle")
    assert b.stats()["engine"]["shared_adopted"] == 9
    assert a.ask("invalidate", key="P")["removed"] == 9
    eventually(lambda: not any(b.ask("contains", key=k)["contains"] for k in ["P", *keys]))
    assert b.get_many(["P", *keys]) == [None] * 9
    assert b.stats()["shared"]["invalidations_received"] >= 1
    assert a.get("k1") is None


def test_a_frozen_process_catches_up_on_invalidations(
        redis_url: str, start_peers: Callable[[str], tuple[Peer, Peer]]) -> None:
    a, b = start_peers(redis_url)
    for i in range(4):
        a.put(f"k{i}", value_of(i))
    a.ask("settle")
    assert b.get_many([f"k{i}" for i in range(4)]) == [sha(value_of(i)) for i in range(4)]
    b.ask("settle")
    os.kill(b.process.pid, signal.SIGSTOP)
    try:
        assert a.ask("invalidate", key="k1")["removed"] == 1
        a.put("k2", value_of(22))  # an overwrite invalidates the old value too
        a.ask("settle")
        time.sleep(0.5)  # past B's timeout: its read of the log in flight has expired
    finally:
        os.kill(b.process.pid, signal.SIGCONT)
    eventually(lambda: b.get("k1") is None and b.get("k2") == sha(value_of(22)))
    assert b.get("k0") == sha(value_of(0))
    assert b.get("k3") == sha(value_of(3))
    stats = b.stats()["shared"]
    assert stats["invalidations_received"] >= 2
    assert stats["log_connected"]


@pytest.mark.crash
def test_the_server_killed_and_restarted_under_both(
        fresh_redis_server: RedisServer, start_peers: Callable[[str], tuple[Peer, Peer]]) -> None:
    server = fresh_redis_server
    a, b = start_peers(server.url)
    a.put("k1", value_of(1))
    a.ask("settle")
    assert b.get("k1") == sha(value_of(1))
    b.ask("settle")
    server.kill()
    a.put("k2", value_of(2))  # local; the copy to the server fails in the background
    a.ask("settle")
    assert a.get_many(["k1", "k2"]) == [sha(value_of(1)), sha(value_of(2))]
    assert b.get("k1") == sha(value_of(1))
    assert b.get("k2") is None  # a miss, not an error
    server.restart()
    for _attempt in range(3):  # the first put after the restart may meet a broken connection
        shared = a.stats()["engine"]["shared"].get(SHARED, 0)
        a.put("k3", value_of(3))
        a.ask("settle")
        if a.stats()["engine"]["shared"].get(SHARED, 0) > shared:
            break
    else:
        pytest.fail("A never shared a put after the restart")
    eventually(lambda: b.get("k3") == sha(value_of(3)))
    assert b.get("k1") == sha(value_of(1))
    assert a.get_many(["k1", "k2", "k3"]) == [sha(value_of(i)) for i in (1, 2, 3)]
    a.ask("invalidate", key="k3")
    eventually(lambda: b.get("k3") is None)
