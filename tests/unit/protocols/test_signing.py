import dataclasses
import hashlib
import os

import pytest

from protocols.errors import KeyFileError, SignatureError
from protocols.messages import RolloutBatch, RunManifest, WeightUpdate
from protocols.signing import (
    FINGERPRINT_CHARS, canonical, fingerprint, generate_key, load_or_create_key, load_private_key, public_bytes,
    save_private_key, sha256_file, sha256_hex, sign_message, verify_body, verify_message,
)
from tests.unit.protocols import factories


@pytest.mark.parametrize(
    "change", [{"temperature": 0.5}, {"staleness": 5}, {"trainer_addrs": ("/ip4/6.6.6.6",)}, {"run_key": bytes(32)}]
)
def test_signature_survives_the_wire_and_covers_fields(change):
    key = generate_key()
    manifest = sign_message(factories.manifest(run_key=public_bytes(key)), key)
    received = RunManifest.from_wire(manifest.to_wire())
    verify_message(received, public_bytes(key))
    with pytest.raises(SignatureError, match="does not verify"):
        verify_message(dataclasses.replace(received, **change), public_bytes(key))


def test_batch_signed_by_node_key():
    node = generate_key()
    batch = sign_message(factories.batch(node_key=public_bytes(node)), node)
    received = RolloutBatch.from_wire(batch.to_wire())
    verify_message(received, received.node_key)
    assert received.node_id == fingerprint(public_bytes(node))
    forged = dataclasses.replace(received, version=received.version + 1)
    with pytest.raises(SignatureError):
        verify_message(forged, forged.node_key)


def test_wrong_key_missing_and_garbage_signatures():
    key, other = generate_key(), generate_key()
    update = sign_message(factories.update(), key)
    with pytest.raises(SignatureError, match=fingerprint(public_bytes(other))):
        verify_message(update, public_bytes(other))
    with pytest.raises(SignatureError, match="missing"):
        verify_message(factories.update(), public_bytes(key))
    with pytest.raises(SignatureError):
        verify_message(dataclasses.replace(update, signature=bytes(64)), public_bytes(key))
    with pytest.raises(SignatureError):
        verify_message(update, b"not a key")
    verify_message(WeightUpdate.from_wire(update.to_wire()), public_bytes(key))


def test_a_signature_is_good_for_its_own_kind_only():
    key = generate_key()
    update = sign_message(factories.update(), key)
    body = {**update.to_dict(), "signature": update.signature}
    verify_body(body, public_bytes(key), update.KIND)
    with pytest.raises(SignatureError):  # the same fields, read as another kind of message
        verify_body(body, public_bytes(key), "run_manifest")


def test_canonical_ignores_key_order_and_signature():
    assert canonical({"b": 1, "a": {"y": 2, "x": 3}}, "k") == canonical({"a": {"x": 3, "y": 2}, "b": 1, "signature": b"s"}, "k")
    assert canonical({"b": 1}, "k") != canonical({"b": 1}, "other_kind")


def test_fingerprint_is_short_stable_and_distinct():
    a, b = public_bytes(generate_key()), public_bytes(generate_key())
    assert len(fingerprint(a)) == FINGERPRINT_CHARS and fingerprint(a) == fingerprint(a) != fingerprint(b)
    assert fingerprint(a).isalnum() and fingerprint(a).islower()


def test_key_file_is_private_and_round_trips(tmp_path):
    path = tmp_path / "run.key"
    key = load_or_create_key(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert public_bytes(load_private_key(path)) == public_bytes(key)
    assert public_bytes(load_or_create_key(path)) == public_bytes(key)


def test_readable_by_others_or_malformed_key_files_are_refused(tmp_path):
    path = tmp_path / "run.key"
    save_private_key(generate_key(), path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_private_key(path)
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not pem")
    os.chmod(garbage, 0o600)
    with pytest.raises(KeyFileError, match="not a PEM"):
        load_private_key(garbage)
    with pytest.raises(KeyFileError, match="no key file"):
        load_private_key(tmp_path / "absent.key")


def test_sha256_helpers(tmp_path):
    data = os.urandom(3 * 2**20 + 17)
    (tmp_path / "m.gguf").write_bytes(data)
    assert sha256_file(tmp_path / "m.gguf") == sha256_hex(data) == hashlib.sha256(data).hexdigest()
