"""A record handed to redis-py as header and payload (`tierkv.tiers.redis._joined`) goes on the
wire exactly as the joined value would: the same RESP bytes, for each connection class."""

from __future__ import annotations

import os

import pytest

redis_asyncio = pytest.importorskip("redis.asyncio")

from redis.asyncio.connection import (  # noqa: E402 (after the skip)
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)

from tierkv.tiers.redis._joined import Joined, joining, record_value  # noqa: E402


@pytest.mark.parametrize("base", [Connection, SSLConnection, UnixDomainSocketConnection])
@pytest.mark.parametrize("size", [0, 1, 5999, 6001, 1 << 20])
def test_a_joined_value_is_packed_as_the_joined_bytes(base: type, size: int) -> None:
    header, payload = b"\x93header", os.urandom(size)
    joined_class = joining(base)
    assert issubclass(joined_class, base) and joining(base) is joined_class
    assert joining(joined_class) is joined_class
    connection = joined_class()
    plain = base()
    for args in ((b"SET", b"k", Joined(header, payload)),
                 ("SET", b"\x02key", Joined(header, payload), "PX", 1500)):
        expected = [(header + payload) if type(a) is Joined else a for a in args]
        assert b"".join(connection.pack_command(*args)) == b"".join(plain.pack_command(*expected))
        assert (b"".join(connection.pack_commands([args, args]))
                == b"".join(plain.pack_commands([expected, expected])))
    # commands without a joined value are packed by redis-py itself
    assert connection.pack_command("GET", b"k") == plain.pack_command("GET", b"k")


def test_only_immutable_payloads_are_sent_unjoined() -> None:
    data = os.urandom(100)
    assert isinstance(record_value(b"h", data), Joined)
    copied = record_value(b"h", memoryview(bytearray(data)))
    assert copied == b"h" + data and type(copied) is bytes
    assert bytes(Joined(b"h", data)) == b"h" + data and len(Joined(b"h", data)) == 101
