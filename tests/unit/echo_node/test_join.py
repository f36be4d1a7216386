"""Joining: nothing of the run is used before it verifies against the pinned key; a bad DHT
record falls back to the coordinator, whose answer is final; the base model must be the run's."""

import asyncio
import dataclasses
import time

import pytest

from echo_node import join
from echo_node.config import JoinRefused, Stopped
from echo_node.session import Session
from protocols.errors import TransportError
from protocols.signing import fingerprint, generate_key, public_bytes, sha256_file, sign_message
from tests.unit.echo_node.conftest import ADDRESS, config
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id


def signed_manifest(key=None, **kw):
    key = key or generate_key()
    return sign_message(factories.manifest(run_key=public_bytes(key), **kw), key), key


def session_trusting(tmp_path, manifest, **kw) -> Session:
    return Session(config(tmp_path, run_key=fingerprint(manifest.run_key), **kw))


def test_a_manifest_is_used_only_if_it_is_signed_by_the_pinned_key():
    manifest, _ = signed_manifest()
    pinned = fingerprint(manifest.run_key)
    assert join.verify_manifest(manifest.to_wire(), pinned, ADDRESS) == manifest
    other, _ = signed_manifest()
    with pytest.raises(JoinRefused, match=f"signed by key {fingerprint(other.run_key)}, not the key {pinned}"):
        join.verify_manifest(other.to_wire(), pinned, ADDRESS)
    forged = dataclasses.replace(manifest, staleness=manifest.staleness + 1)  # the old signature, altered content
    with pytest.raises(JoinRefused, match="signature is invalid"):
        join.verify_manifest(forged.to_wire(), pinned, ADDRESS)
    with pytest.raises(JoinRefused, match="malformed"):
        join.verify_manifest(b"\x00junk", pinned, ADDRESS)


class Records:
    """A DHT holding `value` under every key."""

    def __init__(self, value):
        self.value, self.gets = value, 0

    async def get(self, key):
        self.gets += 1
        return self.value


class Coordinator:
    """An endpoint whose coordinator answers the manifest request with `answers`, in turn."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    async def call_one(self, peer, handler, request=None, idempotent=False, timeout=None):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return handler.decode_reply(answer)  # as the real endpoint does


def test_a_bad_dht_record_is_ignored_and_the_coordinator_asked(tmp_path):
    good, _ = signed_manifest()
    planted, _ = signed_manifest()  # a valid manifest of someone else's run
    session = session_trusting(tmp_path, good)
    found = asyncio.run(join.fetch_manifest(session, Records(planted.to_wire()), Coordinator(good.to_wire())))
    assert found == good


def test_the_coordinators_answer_is_final_so_a_wrong_key_is_reported_at_once(tmp_path):
    good, _ = signed_manifest()
    other, _ = signed_manifest()
    session = session_trusting(tmp_path, good)
    started = time.monotonic()
    with pytest.raises(JoinRefused, match="signed by key"):
        asyncio.run(join.fetch_manifest(session, Records(None), Coordinator(other.to_wire())))
    assert time.monotonic() - started < 1.0  # not after MANIFEST_WAIT


def test_a_run_not_found_in_time_is_refused_with_the_join_line_to_check(tmp_path, monkeypatch):
    monkeypatch.setattr(join, "MANIFEST_WAIT", 0.5)
    good, _ = signed_manifest()
    session = session_trusting(tmp_path, good)
    coordinator = Coordinator(*[TransportError("not up yet")] * 10)
    with pytest.raises(JoinRefused, match="found via .* within 0 s; check the join line"):
        asyncio.run(join.fetch_manifest(session, Records(None), coordinator))
    assert coordinator.calls >= 1
    # It turns up within the wait: found.
    session = session_trusting(tmp_path, good)
    found = asyncio.run(join.fetch_manifest(session, Records(None), Coordinator(TransportError("x"), good.to_wire())))
    assert found == good


class Trainer:
    """An endpoint whose trainer serves the run's signed base model list after `failures`."""

    def __init__(self, answer: bytes, failures: int = 0):
        self.answer, self.failures, self.calls = answer, failures, 0

    async def call_one(self, peer, handler, request=None, idempotent=False, timeout=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise TransportError("connection refused")
        return handler.decode_reply(self.answer)  # as the real endpoint does


def test_the_base_model_list_is_retried_while_unreachable_and_refused_if_not_the_runs(session, monkeypatch):
    monkeypatch.setattr("protocols.supervise.Backoff.next", lambda self: 0.0)
    manifest, key = signed_manifest()
    listed = sign_message(factories.model_file(), key)
    trainer = Trainer(listed.to_wire(), failures=2)
    assert asyncio.run(join.model_file(session, trainer, peer_id("Trainer"), manifest)) == listed
    assert trainer.calls == 3
    foreign = sign_message(factories.model_file(), generate_key())
    with pytest.raises(JoinRefused, match="base model list is not valid"):
        asyncio.run(join.model_file(session, Trainer(foreign.to_wire()), peer_id("Trainer"), manifest))
    other_base = sign_message(factories.model_file(sha256="0" * 64), key)
    with pytest.raises(JoinRefused, match="base model list is not valid"):
        asyncio.run(join.model_file(session, Trainer(other_base.to_wire()), peer_id("Trainer"), manifest))


def test_a_stop_while_the_trainer_is_unreachable_ends_the_join(session):
    manifest, key = signed_manifest()
    trainer = Trainer(b"", failures=10**6)

    async def go():
        fetching = asyncio.create_task(join.model_file(session, trainer, peer_id("Trainer"), manifest))
        await asyncio.sleep(0.1)
        session.request_stop()
        return await asyncio.wait_for(fetching, 5)

    with pytest.raises(Stopped, match="before the run's base model was known"):
        asyncio.run(go())


def test_your_model_must_be_the_runs_base(tmp_path):
    own = tmp_path / "mine.gguf"
    own.write_bytes(b"not the base")
    mismatch, _ = signed_manifest()
    session = session_trusting(tmp_path, mismatch, model=own)
    with pytest.raises(JoinRefused, match="is not this run's base model .*leave out --model"):
        asyncio.run(join.base_model(session, None, peer_id("Trainer"), mismatch, factories.model_file(), None))
    match, _ = signed_manifest(base_sha256=sha256_file(own))
    session = session_trusting(tmp_path, match, model=own)
    assert asyncio.run(join.base_model(session, None, peer_id("Trainer"), match, factories.model_file(), None)) == own


def test_the_trainer_is_the_manifests_peer_address():
    assert join.trainer_peer(factories.manifest(trainer_addrs=("/ip4/1.2.3.4/tcp/5", f"/ip4/1.2.3.4/tcp/5/p2p/{peer_id('T')}"))) \
        == peer_id("T")
    with pytest.raises(JoinRefused, match="names no trainer peer"):
        join.trainer_peer(factories.manifest(trainer_addrs=("/ip4/1.2.3.4/tcp/5",)))


def test_phases_add_up_until_the_last(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    phases = join.Phases()
    for phase, seconds in [("DHT", 1.0), ("generation", 2.0), ("generation", 0.5)]:
        now[0] += seconds
        assert not phases.mark(phase)
    now[0] += 0.25
    assert phases.mark("push", last=True)
    now[0] += 9.0
    assert not phases.mark("push", last=True)  # after the last phase: ignored
    assert phases.summary() == "DHT 1.00 s, generation 2.50 s, push 0.25 s" and phases.total() == 3.75
