"""A record sent as its header and its payload, never joined into one buffer first.

A record on the server is one string value, header + payload (`formats/shared_record.py`).
Building it as one `bytes` costs a copy of the payload per put, and at 1 MiB the page faults of
a fresh buffer. So the tier hands redis-py a `Joined` value instead, and its connections
(`joining`: a subclass of whichever connection class the URL chose) pack it as one bulk string
of two chunks, the payload a chunk of its own as redis-py packs any large argument: its bytes
are then copied once, by the transport, as those of a raw ``SET`` are.

Only payloads that cannot change are sent this way (immutable `bytes`): the transport may read
them after the put that gave them has returned or was cancelled (a batch is sent a loop turn
later; Python 3.12's transport keeps views of what the socket has not taken yet). A view of
memory the caller may reuse is copied into the record as before.
"""

from __future__ import annotations

from typing import Any

_CRLF = b"\r\n"


class Joined:
    """One value made of immutable parts, sent back to back as a single bulk string."""

    __slots__ = ("length", "parts")

    def __init__(self, *parts: bytes) -> None:
        self.parts = parts
        self.length = sum(len(part) for part in parts)

    def __len__(self) -> int:
        return self.length

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def record_value(header: bytes, payload: Any) -> Joined | bytes:
    """The value to store for `header` + `payload`: joined on the wire when `payload` is
    immutable `bytes`, else one buffer holding a copy of it (`payload` a memoryview)."""
    if type(payload) is bytes:
        return Joined(header, payload)
    return header + payload  # type: ignore[no-any-return]


#: each connection class → its joining subclass (one class each, however many clients)
_JOINING: dict[type[Any], type[Any]] = {}


def joining(connection_class: type[Any]) -> type[Any]:
    """`connection_class` packing `Joined` arguments as one bulk string of their parts."""
    if getattr(connection_class, "__module__", None) == __name__:
        return connection_class  # joining already
    known = _JOINING.get(connection_class)
    if known is not None:
        return known

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        if not any(type(arg) is Joined for arg in args):
            return base_pack(self, *args)  # type: ignore[no-any-return]
        # a command the tier built (SET key value [PX ms]): no literal words in its name
        output: list[bytes] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if type(arg) is Joined:
                output.append(buff + b"$%d\r\n" % arg.length)
                output.extend(arg.parts)
                buff = _CRLF
            else:
                data = self.encoder.encode(arg)
                buff = b"".join((buff, b"$%d\r\n" % len(data), data, _CRLF))
        output.append(buff)
        return output

    base_pack = connection_class.pack_command
    made = _JOINING[connection_class] = type(
        f"Joining{connection_class.__name__}", (connection_class,),
        {"pack_command": pack_command, "__module__": __name__})
    return made
