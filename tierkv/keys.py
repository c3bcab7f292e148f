"""Cache keys: chained prefix-block keys and the canonical byte form every tier stores.

A key reaches the engine as a `BlockKey`, `bytes` or `str`. Each is turned into one canonical
byte string (`encode_key`) that is the identity of the object everywhere below the public API:
the engine's index, the tier contract, the object header on media. A domain tag byte keeps the
three kinds apart, so ``b"a"`` and ``"a"`` are different keys.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tierkv.errors import CorruptObjectError, LimitExceededError

DIGEST_SIZE = 16
#: longest canonical key (and parent key) an object header and a tombstone record (a 16-bit
#: length) can carry
MAX_KEY_SIZE = (1 << 16) - 1

_TAG_BLOCK = 0x01
_TAG_BYTES = 0x02
_TAG_STR = 0x03
_BLOCK_TAIL = struct.Struct("<Qd")
_BLOCK_ENCODED_SIZE = 1 + DIGEST_SIZE + _BLOCK_TAIL.size
_CHAIN_DOMAIN = b"tierkv.block.v1\x00"
#: the parent digest a chain's first block is hashed with: it has no parent
ROOT_DIGEST = bytes(DIGEST_SIZE)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Key of one KV-cache block of a token prefix.

    `digest` (16 bytes) chains the namespace salt, the model id, the parent block's digest and this
    block's token ids, so equal digests mean equal prefixes. `context_length` is the number of
    tokens the key covers; `rope_theta` keeps different position encodings apart (held as the
    float the encoding packs, -0.0 as 0.0, so that equal keys are one object: `_rope_theta`).
    """

    digest: bytes
    context_length: int
    rope_theta: float
    #: the model version ("name@revision") the block was computed with, as `block_keys` was
    #: told; not part of the key's identity (the digest already covers it), but a put hangs the
    #: block under that version, so `invalidate_model` finds it
    model: str | None = field(default=None, compare=False)
    #: the digest of the block before it in its chain, as `block_keys` made it (the zero digest
    #: for a first block; ``None``: not known, as for a key decoded from storage). Not part of
    #: the identity either; `put_many` links a key to its parent by it, never by guessing
    parent_digest: bytes | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_SIZE:
            raise ValueError(f"BlockKey.digest must be {DIGEST_SIZE} bytes")
        if isinstance(self.context_length, bool) or not isinstance(self.context_length, int):
            raise TypeError("BlockKey.context_length must be an int")
        if not 0 <= self.context_length < 2**64:
            raise ValueError("BlockKey.context_length must be a non-negative 64-bit int")
        object.__setattr__(self, "rope_theta", _rope_theta(self.rope_theta))
        if self.model is not None and not isinstance(self.model, str):
            # a put would fail on it only when it hangs the block under the model version
            raise TypeError(f"BlockKey.model is a str or None, not a {type(self.model).__name__}")
        if self.parent_digest is not None and (not isinstance(self.parent_digest, bytes)
                                               or len(self.parent_digest) != DIGEST_SIZE):
            raise ValueError(f"BlockKey.parent_digest must be None or {DIGEST_SIZE} bytes")


def _rope_theta(theta: object) -> float:
    """`theta` as the float a `BlockKey` holds and its encoding packs; `ValueError` unless it is
    a finite number.

    Two keys must be equal exactly when their encodings are (the encoding is the object's
    identity below the API, equality and hashing are the caller's): the encoding packs the
    float64, and among finite floats only 0.0 and -0.0 compare equal with different bits, so
    -0.0 becomes 0.0; NaN, never equal even to itself, is refused; an int, which Python compares
    exactly but the encoding rounds, becomes the float it is stored as."""
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real):
        raise ValueError("BlockKey.rope_theta must be a finite number")
    try:
        value = float(theta)
    except OverflowError:  # an int too large for a float
        value = math.inf
    if not math.isfinite(value):
        raise ValueError("BlockKey.rope_theta must be a finite number")
    return value + 0.0  # -0.0 + 0.0 is 0.0; every other float is unchanged


Key = BlockKey | bytes | str


def block_keys(
    token_ids: Sequence[int],
    *,
    block_size: int,
    model: str,
    rope_theta: float,
    namespace: bytes | bytearray | memoryview = b"",
) -> list[BlockKey]:
    """One chained `BlockKey` per *full* block of `token_ids` (a partial tail gets no key).

    The digest of block i is SHA-256 over (namespace salt, model, digest of block i-1, the block's
    token ids), truncated to 16 bytes. Every length is framed, so no two different inputs share the
    hashed byte string.

    Raises `TypeError` for a token id or `block_size` that is not an int, a `model` that is not
    a str or a `namespace` that is not bytes, and `ValueError` for a token id outside the signed
    64-bit range, a `block_size` below 1 or a `model` with no UTF-8 form (`LimitExceededError`
    for one longer than a key).
    """
    if isinstance(block_size, bool) or not hasattr(block_size, "__index__"):
        raise TypeError(f"block_size is an int, not {type(block_size).__name__}")
    block_size = block_size.__index__()
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if not isinstance(namespace, bytes | bytearray | memoryview):
        raise TypeError(f"namespace is bytes, not {type(namespace).__name__}")
    salt_namespace = bytes(namespace)
    model_bytes = _utf8(model, "model")
    if len(model_bytes) >= MAX_KEY_SIZE:
        # a put hangs each block under the model version's key (`version_key`), a header parent
        raise LimitExceededError("model bytes", MAX_KEY_SIZE - 1, len(model_bytes))
    salt = hashlib.sha256(
        _CHAIN_DOMAIN
        + struct.pack("<I", len(salt_namespace))
        + salt_namespace
        + struct.pack("<I", len(model_bytes))
        + model_bytes
        + struct.pack("<d", _rope_theta(rope_theta))
    ).digest()
    keys: list[BlockKey] = []
    parent = ROOT_DIGEST
    for end in range(block_size, len(token_ids) + 1, block_size):
        block = token_ids[end - block_size : end]
        hasher = hashlib.sha256(salt)
        hasher.update(parent)
        try:
            packed = struct.pack(f"<{block_size}q", *block)
        except struct.error:
            raise _bad_token(block, end - block_size) from None
        hasher.update(packed)
        digest = hasher.digest()[:DIGEST_SIZE]
        keys.append(BlockKey(digest, end, rope_theta, model, parent))
        parent = digest
    return keys


def _bad_token(block: Sequence[int], start: int) -> TypeError | ValueError:
    """Why `struct` refused to pack `block` (token ids from index `start` on)."""
    for offset, token in enumerate(block):
        index = start + offset
        if not hasattr(token, "__index__"):
            return TypeError(f"token_ids[{index}] is a {type(token).__name__}, not an int")
        if not -(2**63) <= token.__index__() < 2**63:
            return ValueError(f"token_ids[{index}] = {token} is outside the signed 64-bit range")
    return ValueError(f"token_ids[{start}:{start + len(block)}] cannot be packed")


def _utf8(text: str, what: str) -> bytes:
    if not isinstance(text, str):
        # str.encode would be looked up on it: an AttributeError that names no argument
        raise TypeError(f"{what} is a str, not a {type(text).__name__}")
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        # a lone surrogate (from surrogateescape decoding, or a broken JSON escape) has no UTF-8
        # form; UnicodeEncodeError would name the codec, not the argument that is wrong
        raise ValueError(f"{what} is not valid Unicode text: {exc.reason} at position "
                         f"{exc.start}") from None


def encode_key(key: Key) -> bytes:
    """The canonical byte form of a public key (see the module docstring).

    Raises `TypeError` for other types, `LimitExceededError` (a `ValueError`) for keys longer
    than `MAX_KEY_SIZE` and `ValueError` for `str` keys that have no UTF-8 form (a lone
    surrogate).
    """
    if isinstance(key, BlockKey):
        return bytes((_TAG_BLOCK,)) + key.digest + _BLOCK_TAIL.pack(
            key.context_length, key.rope_theta
        )
    if isinstance(key, str):
        raw = bytes((_TAG_STR,)) + _utf8(key, "a str key")
    elif isinstance(key, bytes | bytearray | memoryview):
        raw = bytes((_TAG_BYTES,)) + bytes(key)
    else:
        raise TypeError(f"a key is a BlockKey, bytes or str, not {type(key).__name__}")
    if len(raw) > MAX_KEY_SIZE:  # one byte goes to the domain tag
        raise LimitExceededError("key bytes", MAX_KEY_SIZE - 1, len(raw) - 1)
    return raw


#: the types of one key, a mistake where many are expected (a tuple: `isinstance` of a union
#: costs several times as much, on every put)
_ONE_KEY = (str, bytes, bytearray, memoryview, BlockKey)


def key_list(keys: Iterable[Key], what: str) -> list[Key]:
    """`keys` (the argument `what` of a call that takes many keys) as a list, iterated once: a
    generator cannot be iterated twice. `TypeError` for one key where many are expected: a
    `str` or `bytes` would otherwise be taken as the keys of its characters or byte values."""
    if isinstance(keys, _ONE_KEY):
        raise TypeError(f"{what} is an iterable of keys, not a single {type(keys).__name__}")
    try:
        return list(keys)
    except TypeError:
        if hasattr(keys, "__iter__"):
            raise  # raised while iterating: the iterable's own error
        raise TypeError(f"{what} is an iterable of keys, not {type(keys).__name__}") from None


def decode_key(raw: bytes) -> Key:
    """The public key a canonical byte form came from; `CorruptObjectError` if it is none."""
    if not raw:
        raise CorruptObjectError("empty key")
    tag = raw[0]
    if tag == _TAG_BYTES:
        return raw[1:]
    if tag == _TAG_STR:
        try:
            return raw[1:].decode()
        except UnicodeDecodeError as exc:
            raise CorruptObjectError("str key is not UTF-8") from exc
    if tag == _TAG_BLOCK and len(raw) == _BLOCK_ENCODED_SIZE:
        length, theta = _BLOCK_TAIL.unpack_from(raw, 1 + DIGEST_SIZE)
        if theta == 0 and math.copysign(1.0, theta) < 0:
            # no key encodes to it (`_rope_theta`): decoded, it would encode to other bytes
            raise CorruptObjectError("block key with rope_theta -0.0 is not canonical")
        try:
            return BlockKey(raw[1 : 1 + DIGEST_SIZE], length, theta)
        except (TypeError, ValueError) as exc:
            raise CorruptObjectError(f"bad block key: {exc}") from exc
    raise CorruptObjectError(f"unknown key encoding (tag {tag:#x}, {len(raw)} bytes)")


#: the tag of model-version nodes in the dependency DAG (no public key encodes to it)
_TAG_VERSION = 0xFE


def version_key(model: str) -> bytes:
    """The DAG node every block computed with `model` ("name@revision") hangs under."""
    return bytes((_TAG_VERSION,)) + _utf8(model, "model")


def is_block_key(raw: bytes) -> bool:
    """Whether canonical key bytes are a `BlockKey`'s."""
    return bool(raw) and raw[0] == _TAG_BLOCK


#: the tag of objects the engine keeps for itself in a persistent tier (no public key encodes
#: to it, and the engine never indexes them)
_TAG_ENGINE = 0xFD
#: where an engine with a shared tier keeps its cursor in the fleet's invalidation log
FLEET_CURSOR_KEY = bytes((_TAG_ENGINE,)) + b"fleet-cursor"
#: where the engine records the deletes a failing device refused (`formats.tombstones`)
TOMBSTONES_KEY = bytes((_TAG_ENGINE,)) + b"tombstones"
#: where an engine with a shared tier keeps the invalidations its server has not taken yet
UNPUBLISHED_KEY = bytes((_TAG_ENGINE,)) + b"unpublished"
#: where each persistent tier records the last session of its hierarchy it took part in
MEMBERSHIP_KEY = bytes((_TAG_ENGINE,)) + b"membership"
#: where the engine records the edges into keys whose objects left (`formats.departed_edges`)
DEPARTED_EDGES_KEY = bytes((_TAG_ENGINE,)) + b"departed-edges"


#: the keys of the profile probe's objects (`engine._profiles`), written, read and deleted at the
#: first put with a latency SLO; one found at open is a leftover of a process killed meanwhile
PROBE_PREFIX = b"\xfftierkv.probe."


def is_engine_key(raw: bytes) -> bool:
    """Whether canonical key bytes name an object the engine keeps for itself."""
    return bool(raw) and raw[0] == _TAG_ENGINE
