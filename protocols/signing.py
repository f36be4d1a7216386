"""Ed25519 keys and signatures, and sha256 content hashes.

A signature covers the *canonical* encoding of a message body: msgpack with every map's keys
sorted and the `signature` field left out, so signer and verifier agree byte for byte whatever
order fields were built in, after the protocol's domain and the message kind (a signature is
only ever good for the kind it was made for). Humans compare keys by `fingerprint` (26 base32 characters of the
public key's sha256: 130 bits, far beyond what a forger can grind).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import stat
from pathlib import Path
from typing import Any, TypeVar

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocols.errors import KeyFileError, MalformedMessage, SignatureError

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
FINGERPRINT_CHARS = 26
SIGNING_DOMAIN = "echo-swarm/signed/2"  # what every signature covers first (`canonical`)

M = TypeVar("M")


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(public_key: bytes) -> str:
    digest = hashlib.sha256(public_key).digest()
    return base64.b32encode(digest).decode().lower()[:FINGERPRINT_CHARS]


def save_private_key(key: Ed25519PrivateKey, path: Path) -> None:
    """Write a PEM key readable by its owner only; the file is complete or absent."""
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise KeyFileError(f"no key file at {path}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"key file {path} is accessible by other users (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}` if you trust its contents"
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except ValueError as e:
        raise KeyFileError(f"key file {path} is not a PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"key file {path} holds a {type(key).__name__}, expected Ed25519")
    return key


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    if Path(path).exists():
        return load_private_key(path)
    key = generate_key()
    save_private_key(key, path)
    return key


MAX_NESTING = 16  # containers within containers in a signed body; our messages nest 4 deep at most


def _sorted(value: Any, depth: int = 0) -> Any:
    if depth > MAX_NESTING:  # peer data: 1,000 nested lists fit in 1 KB and would exhaust Python's stack
        raise MalformedMessage(f"a signed body may nest containers {MAX_NESTING} deep at most")
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):  # peer data: msgpack also allows bytes keys
            raise MalformedMessage("a signed map may only have string keys")
        return {k: _sorted(value[k], depth + 1) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_sorted(v, depth + 1) for v in value]
    return value


def canonical(body: dict[str, Any], kind: str) -> bytes:
    """The bytes a signature covers: this protocol's domain, the message kind, and sorted-key
    msgpack of `body` without its signature. With the kind signed, a signature over one kind of
    message can never pass as another's whose fields happen to match."""
    unsigned = {k: v for k, v in body.items() if k != "signature"}
    return msgpack.packb([SIGNING_DOMAIN, kind, _sorted(unsigned)], use_bin_type=True)


def sign_message(message: M, key: Ed25519PrivateKey) -> M:
    """A copy of a frozen message dataclass with its `signature` field filled in."""
    return dataclasses.replace(message, signature=key.sign(canonical(message.to_dict(), message.KIND)))


def verify_message(message: Any, public_key: bytes) -> None:
    """Raise SignatureError unless `message.signature` is `public_key`'s over its body."""
    verify_body({**message.to_dict(), "signature": message.signature}, public_key, message.KIND)


def verify_body(body: dict[str, Any], public_key: bytes, kind: str) -> None:
    """The same check on a decoded wire body, before it is turned into objects: what a large
    message costs a forger is one scan and one signature check."""
    signature = body.get("signature", b"")
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise SignatureError(f"{kind}: missing or truncated signature")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, canonical(body, kind))
    except (InvalidSignature, ValueError):
        raise SignatureError(f"{kind}: signature does not verify against key {fingerprint(public_key)}") from None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, block: int = 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()
