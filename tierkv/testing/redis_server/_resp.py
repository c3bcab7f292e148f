"""The RESP2 client the test servers are driven with: one command on a connection of its own
(`command`), and the reply it reads back (`Reply`).

Apart from the server classes because it needs no server of ours: it talks to whatever listens
on 127.0.0.1 at a port (plain or TLS), so tests use it to check a server by hand, and the
servers use it for their own readiness and cluster checks, with no redis-py in the way.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from typing import BinaryIO, TypeAlias

from tierkv.errors import DeviceError
from tierkv.testing.redis_tls import wrap

#: a RESP2 reply: simple and bulk strings as bytes, integers, nil, arrays (error replies raise)
Reply: TypeAlias = "bytes | int | list[Reply] | None"

HOST = "127.0.0.1"


def command(port: int, *args: str | bytes | int, password: str | None = None,
            timeout: float = 5.0, tls: ssl.SSLContext | None = None) -> Reply:
    """Send one command to the server at 127.0.0.1:`port` over a connection of its own
    (``AUTH`` first when `password` is given; over TLS with `tls`) and return its reply.

    Raises `OSError` when no connection can be made or it breaks (`ssl.SSLError`, one, when the
    TLS handshake fails), `DeviceError` on an error reply.
    """
    with wrap(socket.create_connection((HOST, port), timeout=timeout), tls, HOST) as sock, \
            sock.makefile("rb") as stream:
        if password is not None:
            sock.sendall(_encode(("AUTH", password)))
            _read_reply(stream)
        sock.sendall(_encode(args))
        return _read_reply(stream)


def _encode(args: Sequence[str | bytes | int]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += [b"$%d\r\n" % len(data), data, b"\r\n"]
    return b"".join(parts)


def _read_reply(stream: BinaryIO) -> Reply:
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionResetError("the redis server closed the connection mid-reply")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise DeviceError(f"redis replied with an error: {rest.decode(errors='replace')}")
    if kind == b":":
        return int(rest)
    if kind == b"$":
        length = int(rest)
        if length < 0:
            return None
        data = stream.read(length + 2)
        if len(data) != length + 2:
            raise ConnectionResetError("the redis server closed the connection mid-reply")
        return data[:-2]
    if kind == b"*":
        count = int(rest)
        return None if count < 0 else [_read_reply(stream) for _ in range(count)]
    raise DeviceError(f"not a RESP2 reply: {line!r}")
