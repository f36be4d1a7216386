"""Fetching the base model's chunks: "busy" (the trainer sent its share) is asked again at once
and never counts as a failure; other failures are retried ATTEMPTS times in all."""

import asyncio
import random

import pytest

from echo_node import base_download
from echo_node.disk import Disk, DiskFull
from echo_node.updates import UpdateError
from protocols.errors import RemoteError, TransportError
from protocols.messages import ModelFile
from protocols.signing import sha256_hex
from protocols.transport.relay import Relay
from tests.unit.echo_node.conftest import RelayTrainer
from tests.unit.protocols.factories import peer_id

BUSY = RemoteError("busy", "sent its share of the base model", peer_id("Trainer"), "echo.chunks")


def served_base(tmp_path, *fail):
    data = random.Random(0).randbytes(10_000)  # 3 chunks, all different
    path = tmp_path / "base.gguf"
    path.write_bytes(data)
    size = 4096
    listed = ModelFile(run_id="run-1", name="base.gguf", sha256=sha256_hex(data), size=len(data), chunk_size=size,
                       chunks=tuple(sha256_hex(data[i : i + size]) for i in range(0, len(data), size)))
    relay = Relay()
    relay.serve_file(listed, path)
    return RelayTrainer(relay, *fail), listed, data


async def no_peers():
    return []


def fetch(tmp_path, endpoint, listed):
    return asyncio.run(base_download.download(endpoint, peer_id("Trainer"), no_peers, listed, Disk(tmp_path, None),
                                              lambda *a: None, 10.0))


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(base_download, "BUSY_RETRY", 0.0)
    monkeypatch.setattr("protocols.supervise.Backoff.next", lambda self: 0.0)


def test_busy_answers_do_not_count_as_failures(tmp_path):
    failures = [BUSY] * (base_download.ATTEMPTS + 2) + [TransportError("stream broke")] * (base_download.ATTEMPTS - 1)
    endpoint, listed, data = served_base(tmp_path, *failures)
    path, sources = fetch(tmp_path, endpoint, listed)
    assert path.read_bytes() == data and sources[peer_id("Trainer")] == len(data)


def test_a_download_gives_up_after_attempts_failures(tmp_path):
    endpoint, listed, _ = served_base(tmp_path, *[TransportError("stream broke")] * base_download.ATTEMPTS)
    with pytest.raises(UpdateError, match="chunks unavailable"):
        fetch(tmp_path, endpoint, listed)
    assert endpoint.calls.count("echo.chunks") == base_download.ATTEMPTS


def test_a_base_larger_than_the_free_disk_is_refused_before_a_byte_is_written(tmp_path):
    """A coordinator may list a 512 GiB model: the node says so and writes nothing."""
    endpoint, listed, _ = served_base(tmp_path)
    huge = ModelFile(run_id="run-1", name="base.gguf", sha256="ab" * 32, size=512 * 2**30, chunk_size=listed.chunk_size,
                     chunks=listed.chunks)
    with pytest.raises(DiskFull, match="512.00 GiB.* free"):
        fetch(tmp_path, endpoint, huge)
    assert list((tmp_path / "models").iterdir()) == [] and endpoint.calls == []


def test_a_peer_that_failed_once_is_asked_again_when_the_trainer_says_peers_hold_it(tmp_path):
    """A relayed peer's first stream broke (its circuit was being set up), and the trainer, having
    sent its share, answers "busy": the peer is forgiven, not shunned for ever (seen in the NAT test)."""
    relayed = peer_id("relayed")
    endpoint, listed, data = served_base(tmp_path)
    asked = []
    serve = endpoint.call

    async def call(peer, handler, payload, on_reply=None, timeout=None):
        asked.append(peer)
        if peer == relayed and asked.count(relayed) == 1:
            raise TransportError("stream broke")
        if peer == "QmTrainer":
            raise BUSY
        return await serve(peer, handler, payload, on_reply, timeout)

    endpoint.call = call

    async def holders():
        return [relayed]

    async def go():
        return await asyncio.wait_for(base_download.download(endpoint, "QmTrainer", holders, listed, Disk(tmp_path, None),
                                                             lambda *a: None, 10.0), 10)

    path, sources = asyncio.run(go())
    assert path.read_bytes() == data and sources == {relayed: len(data)} and asked.count(relayed) >= 2
