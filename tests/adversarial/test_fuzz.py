"""10,000 mutated and random inputs to every decoder a peer can reach: each either decodes or
raises a ProtocolError (the DHT validator: answers False). Nothing else, ever.

Deterministic (seeded), so a failure names an input that can be replayed."""

from __future__ import annotations

import random

import msgpack
import pytest

from protocols import wire
from protocols.errors import ProtocolError
from protocols.messages import NoWork, RolloutBatch, TaskLease
from protocols.signing import generate_key, public_bytes, sign_message
from tests.unit.protocols import factories
from tests.unit.protocols.test_messages import EXAMPLES

INPUTS = 10_000
KEY = generate_key()
SIGNED_BATCH = sign_message(factories.batch(node_key=public_bytes(KEY)), KEY)


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.0, -0.0, float("nan"), float("inf"), -1e308, rng.uniform(-10, 10)])
    if kind == 4:
        return "".join(rng.choice("ab\u00e9\u202e\x00 ") for _ in range(rng.randrange(12)))
    if kind == 5:
        return rng.randbytes(rng.choice([0, 1, 3, 4, 8, 32, 64, 65]))
    if kind == 6:
        return "x" * rng.choice([257, 70_000])
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {random_value(rng, 3) if rng.random() < 0.2 else str(rng.randrange(5)): random_value(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def mutate_body(rng: random.Random, body):
    """Replace, drop or add one field somewhere in the (nested) body."""
    if isinstance(body, dict) and body:
        key = rng.choice(list(body))
        choice = rng.randrange(4)
        if choice == 0:
            return {k: v for k, v in body.items() if k != key}
        if choice == 1 and isinstance(body[key], (dict, list)) and body[key]:
            return {**body, key: mutate_body(rng, body[key])}
        if choice == 2:
            return {**body, f"unknown_{rng.randrange(3)}": random_value(rng)}
        return {**body, key: random_value(rng)}
    if isinstance(body, list) and body:
        i = rng.randrange(len(body))
        return body[:i] + [mutate_body(rng, body[i]) if rng.random() < 0.5 else random_value(rng)] + body[i + 1:]
    return random_value(rng)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(4)
        i = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(i, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[i:i] = rng.randbytes(rng.randrange(1, 9))
        elif op == 2:
            del data[i : i + rng.randrange(1, 9)]
        else:
            data = data[:i]
    return bytes(data)


KINDS = ("random", "bytes", "fields")


def inputs(example, seed: int):
    """INPUTS (kind, byte string) pairs: a third random bytes, a third byte-mutated encodings, a
    third field-mutated bodies (a field replaced, dropped or added)."""
    rng = random.Random(seed)
    valid = example.to_wire()
    body = msgpack.unpackb(valid, raw=False)["body"]
    for i in range(INPUTS):
        if i % 3 == 0:
            yield "random", rng.randbytes(rng.randrange(64))
        elif i % 3 == 1:
            yield "bytes", mutate_bytes(rng, valid)
        else:
            yield "fields", wire.pack(example.KIND, mutate_body(rng, body))


def only_protocol_errors(decode, example, seed: int) -> dict[str, list]:
    """Feed every input to `decode`: anything but success or a ProtocolError fails the test.
    Returns what decoded, by kind of input."""
    decoded: dict[str, list] = {kind: [] for kind in KINDS}
    for kind, data in inputs(example, seed):
        try:
            decoded[kind].append(decode(data))
        except ProtocolError:
            pass
    return decoded


def counts(decoded: dict[str, list]) -> dict[str, int]:
    return {kind: len(values) for kind, values in decoded.items()}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda m: m.KIND)
def test_every_message_decoder(example):
    decoded = counts(only_protocol_errors(type(example).from_wire, example, seed=len(example.KIND)))
    per_kind = INPUTS // 3
    assert decoded["random"] == 0  # random bytes are never a message
    # Strict and tolerant at once: some field mutations still decode (an unknown field added, an
    # optional one dropped), most are refused (a wrong type, a missing required field).
    assert 0 < decoded["fields"] < 0.8 * per_kind, decoded


def test_lease_reply_decoder():
    decoded = counts(only_protocol_errors(lambda data: wire.decode_one_of(data, (TaskLease, NoWork)), factories.lease(),
                                          seed=1))
    assert decoded["random"] == 0 and 0 < decoded["fields"] < 0.8 * (INPUTS // 3), decoded


def test_push_decoder_checks_the_signature_first():
    """The trainer's first look at a push: nothing but a correctly signed body gets past it."""
    original = RolloutBatch.signed_body(SIGNED_BATCH.to_wire())
    passed = only_protocol_errors(RolloutBatch.signed_body, SIGNED_BATCH, seed=2)
    assert not passed["random"], counts(passed)
    # A byte mutation gets past only where it leaves the message as it was (msgpack can spell one
    # value two ways); a field mutation only where the signature does not cover it.
    assert all(body == original for body in passed["bytes"]), counts(passed)
    assert sum(counts(passed).values()) < 0.05 * INPUTS, counts(passed)


def test_dht_record_validator():
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time

    from protocols.signing import fingerprint
    from hivemind.dht.routing import DHTID

    from protocols.transport.dht import RunRecords, record_key

    run_key = generate_key()
    validator = RunRecords(fingerprint(public_bytes(run_key)))
    manifest = sign_message(factories.manifest(run_key=public_bytes(run_key)), run_key)
    assert validator.validate(DHTRecord(validator.manifest_key, DHTProtocol.IS_REGULAR_VALUE,
                                        MSGPackSerializer.dumps(manifest.to_wire()), 0.0))
    # Pinned for a year: refused. The manifest under a subkey (a node's record): refused.
    assert not validator.validate(DHTRecord(validator.manifest_key, DHTProtocol.IS_REGULAR_VALUE,
                                            MSGPackSerializer.dumps(manifest.to_wire()), get_dht_time() + 3e7))
    assert not validator.validate(DHTRecord(validator.manifest_key, MSGPackSerializer.dumps("node"),
                                            MSGPackSerializer.dumps(manifest.to_wire()), 0.0))
    other_key = DHTID.generate(source=record_key(validator.fp, "peers")).to_bytes()
    rng = random.Random(3)
    accepted = 0
    for i, (_, data) in enumerate(inputs(manifest, seed=3)):
        key = validator.manifest_key if i % 2 else other_key
        subkey = DHTProtocol.IS_REGULAR_VALUE if i % 4 < 2 else MSGPackSerializer.dumps(rng.randbytes(4))
        value = MSGPackSerializer.dumps(data) if i % 5 else rng.randbytes(rng.randrange(40))
        accepted += validator.validate(DHTRecord(key, subkey, value, 0.0))
    assert accepted < 0.05 * INPUTS
