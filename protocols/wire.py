"""The msgpack envelope every message travels in, and the field readers that validate it.

An envelope is a msgpack map `{"protocol": int, "kind": str, "body": map}`. Readers are
tolerant of what they do not know (unknown body fields are ignored, so newer peers stay
compatible) and strict about what they do: a missing field, a wrong type or a value outside
its limits raises a `ProtocolError` subclass naming the message kind and the field.

Arrays (token ids, logprobs, tensor payloads) travel as little-endian bytes plus a known dtype,
never as msgpack lists of numbers: smaller, faster, and their length is checked in O(1).
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import msgpack
import numpy as np

from protocols.errors import InvalidValue, MalformedMessage, MessageTooLarge, UnsupportedVersion
from protocols.multiaddr import MAX_PEER_ID_CHARS, is_peer_id
from protocols.signing import SIGNATURE_BYTES

PROTOCOL_VERSION = 2  # 2: signatures cover the message kind (`protocols.signing.canonical`)
# Anything bigger than this is refused before msgpack looks at it. Messages set tighter caps.
MAX_MESSAGE_BYTES = 64 * 2**20
MAX_NAME_CHARS = 256
MAX_INT = 2**63 - 1
MAX_PARAMS = 64  # entries of a free-form parameter map
# Control characters but tab and newline (C0, DEL, C1): text from peers reaches volunteers' terminals.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def pack(kind: str, body: dict[str, Any]) -> bytes:
    return msgpack.packb({"protocol": PROTOCOL_VERSION, "kind": kind, "body": body}, use_bin_type=True)


def envelope(data: bytes, what: str, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[Any, dict[str, Any]]:
    """Decode an envelope and return (kind, body); `what` names the expected kind(s) in errors."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise MessageTooLarge(f"{what}: {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        # The container caps stop a small message from claiming huge arrays or maps.
        decoded = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=max_bytes,
            max_array_len=min(max_bytes, 2**20), max_map_len=min(max_bytes, 2**20),
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise MalformedMessage(f"{what}: not valid msgpack ({e})") from None
    if not isinstance(decoded, dict):
        raise MalformedMessage(f"{what}: envelope is {type(decoded).__name__}, expected a map")
    version = decoded.get("protocol")
    if type(version) is not int:
        raise MalformedMessage(f"{what}: envelope has no integer 'protocol' field")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"{what}: peer speaks protocol {version}, we speak {PROTOCOL_VERSION}")
    body = decoded.get("body")
    if not isinstance(body, dict):
        raise MalformedMessage(f"{what}: body is {type(body).__name__}, expected a map")
    return decoded.get("kind"), body


def unpack(data: bytes, kind: str, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Decode an envelope of the expected `kind` and return its body."""
    got, body = envelope(data, kind, max_bytes)
    if got != kind:
        raise MalformedMessage(f"expected a {kind} message, got {got!r}")
    return body


def decode_one_of(data: bytes, classes: tuple[type, ...]):
    """Decode a reply that may be any of `classes` (e.g. TaskLease or NoWork), by its kind."""
    kinds = {cls.KIND: cls for cls in classes}
    names = ", ".join(kinds)
    kind, body = envelope(data, names, max(cls.MAX_BYTES for cls in classes))
    if kind not in kinds:
        raise MalformedMessage(f"expected one of {names}, got {kind!r}")
    cls = kinds[kind]
    if len(data) > cls.MAX_BYTES:
        raise MessageTooLarge(f"{kind}: {len(data)} bytes exceeds the limit of {cls.MAX_BYTES}")
    return cls.from_dict(body)


class Fields:
    """Typed access to one decoded map; every error names `where` and the field."""

    def __init__(self, body: Any, where: str):
        if not isinstance(body, dict):
            raise MalformedMessage(f"{where}: expected a map, got {type(body).__name__}")
        self.body, self.where = body, where

    def _get(self, name: str, types: tuple[type, ...], what: str) -> Any:
        if name not in self.body:
            raise MalformedMessage(f"{self.where}: missing field '{name}'")
        value = self.body[name]
        # bool is an int subclass; a True where a count belongs is a type error, not 1.
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise MalformedMessage(f"{self.where}.{name}: expected {what}, got {type(value).__name__}")
        return value

    def has(self, name: str) -> bool:
        return name in self.body

    def text(self, name: str, max_chars: int = MAX_NAME_CHARS, choices: tuple[str, ...] = ()) -> str:
        value = self._get(name, (str,), "a string")
        if len(value) > max_chars:
            raise MessageTooLarge(f"{self.where}.{name}: {len(value)} characters exceeds {max_chars}")
        if _CONTROL.search(value):  # a terminal would act on them: links, clipboard writes, fake lines
            raise InvalidValue(f"{self.where}.{name}: control characters are not allowed in text")
        if choices and value not in choices:
            raise InvalidValue(f"{self.where}.{name}: {value!r} is not one of {', '.join(choices)}")
        return value

    def integer(self, name: str, lo: int = 0, hi: int = MAX_INT) -> int:
        value = self._get(name, (int,), "an integer")
        if not lo <= value <= hi:
            raise InvalidValue(f"{self.where}.{name}: {value} is outside [{lo}, {hi}]")
        return value

    def number(self, name: str, lo: float = -math.inf, hi: float = math.inf) -> float:
        value = float(self._get(name, (int, float), "a number"))
        if not math.isfinite(value) or not lo <= value <= hi:
            raise InvalidValue(f"{self.where}.{name}: {value} is not a finite number in [{lo}, {hi}]")
        return value

    def flag(self, name: str) -> bool:
        return self._get(name, (bool,), "a boolean")

    def blob(self, name: str, max_bytes: int, exact: int | None = None) -> bytes:
        value = bytes(self._get(name, (bytes,), "bytes"))
        if len(value) > max_bytes:
            raise MessageTooLarge(f"{self.where}.{name}: {len(value)} bytes exceeds {max_bytes}")
        if exact is not None and len(value) != exact:
            raise InvalidValue(f"{self.where}.{name}: {len(value)} bytes, expected exactly {exact}")
        return value

    def items(self, name: str, max_items: int) -> list[Any]:
        value = self._get(name, (list, tuple), "a list")
        if len(value) > max_items:
            raise MessageTooLarge(f"{self.where}.{name}: {len(value)} items exceeds {max_items}")
        return list(value)

    def peer_id(self, name: str) -> str:
        """A libp2p peer id (`protocols.multiaddr.is_peer_id`): peers dial it."""
        value = self.text(name, MAX_PEER_ID_CHARS)
        if not is_peer_id(value):
            raise InvalidValue(f"{self.where}.{name}: {value[:MAX_PEER_ID_CHARS]!r} is not a libp2p peer id")
        return value

    def peer_ids(self, name: str, max_items: int) -> list[str]:
        values = self.texts(name, max_items, MAX_PEER_ID_CHARS)
        for i, v in enumerate(values):
            if not is_peer_id(v):
                raise InvalidValue(f"{self.where}.{name}[{i}]: {v!r} is not a libp2p peer id")
        return values

    def texts(self, name: str, max_items: int, max_chars: int = MAX_NAME_CHARS) -> list[str]:
        values = self.items(name, max_items)
        for i, v in enumerate(values):
            if not isinstance(v, str) or len(v) > max_chars:
                raise MalformedMessage(f"{self.where}.{name}[{i}]: expected a string of at most {max_chars} characters")
            if _CONTROL.search(v):
                raise InvalidValue(f"{self.where}.{name}[{i}]: control characters are not allowed in text")
        return values

    def integers(self, name: str, max_items: int, lo: int = 0, hi: int = MAX_INT) -> list[int]:
        values = self.items(name, max_items)
        for i, v in enumerate(values):
            if type(v) is not int or not lo <= v <= hi:
                raise InvalidValue(f"{self.where}.{name}[{i}]: expected an integer in [{lo}, {hi}], got {v!r}")
        return values

    def sha256(self, name: str) -> str:
        value = self.text(name, 64)
        if not _SHA256.fullmatch(value):
            raise InvalidValue(f"{self.where}.{name}: {value!r} is not a lowercase hex sha256")
        return value

    def sha256s(self, name: str, max_items: int) -> list[str]:
        values = self.texts(name, max_items, 64)
        if not all(_SHA256.fullmatch(v) for v in values):
            raise InvalidValue(f"{self.where}.{name}: every entry must be a lowercase hex sha256")
        return values

    def params(self, name: str, max_items: int = MAX_PARAMS) -> dict[str, Any]:
        """A free-form map of short string keys to scalars (task parameters, LoRA alpha, ...)."""
        params = {}
        for key, value in self.mapping(name, max_items).items():
            if not isinstance(key, str) or len(key) > 64:
                raise MalformedMessage(f"{self.where}.{name}: keys must be strings of at most 64 characters")
            params[key] = scalar(value, f"{self.where}.{name}.{key}")
        return params

    def signature(self) -> bytes:
        """Optional on the wire (unsigned drafts); verification rejects an empty one."""
        return self.blob("signature", SIGNATURE_BYTES) if self.has("signature") else b""

    def mapping(self, name: str, max_items: int) -> dict[str, Any]:
        value = self._get(name, (dict,), "a map")
        if len(value) > max_items:
            raise MessageTooLarge(f"{self.where}.{name}: {len(value)} entries exceeds {max_items}")
        return value

    def array(self, name: str, dtype: str, max_items: int) -> np.ndarray:
        """A little-endian array sent as bytes; `dtype` like '<i4' or '<f4'."""
        itemsize = np.dtype(dtype).itemsize
        raw = self.blob(name, max_items * itemsize)
        if len(raw) % itemsize:
            raise InvalidValue(f"{self.where}.{name}: {len(raw)} bytes is not a whole number of {dtype}")
        return np.frombuffer(raw, dtype=dtype)


def array_bytes(values: Any, dtype: str) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def scalar(value: Any, where: str) -> Any:
    """Task parameters and similar free-form maps hold only str/int/float/bool scalars."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidValue(f"{where}: {value} is not finite")
    if not isinstance(value, (str, int, float, bool)):
        raise MalformedMessage(f"{where}: expected a string, number or boolean, got {type(value).__name__}")
    if isinstance(value, str) and len(value) > MAX_NAME_CHARS:
        raise MessageTooLarge(f"{where}: {len(value)} characters exceeds {MAX_NAME_CHARS}")
    return value


class WireMessage:
    """Mixin: `to_wire`/`from_wire` around the `to_dict`/`from_dict` every message defines."""

    KIND: ClassVar[str]
    MAX_BYTES: ClassVar[int] = MAX_MESSAGE_BYTES

    def to_wire(self) -> bytes:
        data = pack(self.KIND, self.to_dict())
        if len(data) > self.MAX_BYTES:
            raise MessageTooLarge(f"{self.KIND}: {len(data)} bytes exceeds the limit of {self.MAX_BYTES}")
        return data

    @classmethod
    def from_wire(cls, data: bytes):
        return cls.from_dict(unpack(data, cls.KIND, cls.MAX_BYTES))
