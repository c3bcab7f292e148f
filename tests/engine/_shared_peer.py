"""An engine process for the shared-tier tests (run as a script, not collected by pytest).

``python -m tests.engine._shared_peer CONFIG_JSON``: opens the engine on the config (a JSON
mapping for `tierkv.open`), prints ``{"ready": true}``, then answers one command per line on
stdin with one JSON line on stdout, until ``close`` or the end of stdin. Commands (keys are
strings, values hex):

- ``{"op": "put", "key": K, "value": HEX, "parents": [K, ...]}`` → ``{}``
- ``{"op": "get", "key": K}`` → ``{"sha256": HEX | null}`` (of the value's bytes)
- ``{"op": "get_many", "keys": [K, ...]}`` → ``{"sha256": [HEX | null, ...]}``
- ``{"op": "contains", "key": K}`` → ``{"contains": BOOL}``
- ``{"op": "invalidate", "key": K}`` → ``{"removed": N}``
- ``{"op": "settle"}`` → ``{}``
- ``{"op": "stats", "tier": NAME}`` → ``{"engine": {...}, "shared": {...}}`` (that tier's)
- ``{"op": "close"}`` → ``{}``, and the process exits

Stdin is read on a thread, so the engine's background work (the follower of the fleet's log
above all) runs between commands. A command that raises answers ``{"error": "Type: text"}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from typing import Any

import tierkv


def digest(value: bytes | Any | None) -> str | None:
    if value is None:
        return None
    assert isinstance(value, bytes), type(value)
    return hashlib.sha256(value).hexdigest()


async def answer(kv: tierkv.Engine, command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    if op == "put":
        await kv.put(command["key"], bytes.fromhex(command["value"]),
                     parents=command.get("parents", []))
        return {}
    if op == "get":
        return {"sha256": digest(await kv.get(command["key"]))}
    if op == "get_many":
        return {"sha256": [digest(value) for value in await kv.get_many(command["keys"])]}
    if op == "contains":
        return {"contains": await kv.contains(command["key"])}
    if op == "invalidate":
        return {"removed": await kv.invalidate(command["key"])}
    if op == "settle":
        await kv.settle()
        return {}
    if op == "stats":
        stats = kv.stats()
        return {"engine": stats["engine"], "shared": stats["tiers"][command["tier"]]}
    raise ValueError(f"unknown op {op!r}")


def reply(message: dict[str, Any]) -> None:
    print(json.dumps(message, default=str), flush=True)


async def serve(config: dict[str, Any]) -> None:
    async with tierkv.open(config) as kv:
        reply({"ready": True})
        while line := await asyncio.to_thread(sys.stdin.readline):
            command = json.loads(line)
            if command["op"] == "close":
                break
            try:
                reply(await answer(kv, command))
            except Exception as exc:  # the test reads it; the engine stays up
                reply({"error": f"{type(exc).__name__}: {exc}"})
    reply({})


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
