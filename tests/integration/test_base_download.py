"""A node fetching the run's base model over real hivemind streams: from the trainer and from
peers, resuming a partial file, through corrupt peers and the trainer's upload budget, and
refusing a chunk list the run key did not sign."""

import asyncio
import os
import time

import pytest

from echo_coordinator.base_model import model_file
from echo_node.disk import Disk
from echo_node.base_download import download, fetch_model_file, progress_line
from echo_node.updates import UpdateError
from protocols.errors import SignatureError
from protocols.signing import generate_key, public_bytes, sha256_file
from protocols.transport.dht import SwarmDHT
from protocols.transport.relay import Relay
from protocols.uploads import UploadBudget
from tests.unit.protocols import factories

CHUNK = 16 * 1024
SIZE = 10 * CHUNK + 123  # 11 chunks, the last one short


@pytest.fixture
def swarm():
    peers = [SwarmDHT.start("127.0.0.1", 0)]
    peers += [SwarmDHT.start("127.0.0.1", 0, initial_peers=peers[0].addresses()) for _ in range(2)]
    yield peers
    for p in peers:
        p.shutdown()


@pytest.fixture
def base(tmp_path):
    """A random 'model' file, its signed chunk list, and the run manifest that names it."""
    path = tmp_path / "base.gguf"
    path.write_bytes(os.urandom(SIZE))
    key = generate_key()
    listing = model_file(path, "run-1", key, chunk_size=CHUNK)
    run = factories.manifest(run_key=public_bytes(key), base_sha256=listing.sha256)
    return path, listing, run


class Corrupt(Relay):
    """Serves every chunk it is asked for, with one byte flipped."""

    def chunk(self, digest, peer="", now=None):
        data = super().chunk(digest, peer, now)
        return None if data is None else bytes([data[0] ^ 1]) + data[1:]


async def provider(dht, listing, path, relay=None) -> str:
    relay = relay or Relay()
    relay.serve_file(listing, path)
    endpoint = await dht.endpoint()
    await relay.serve(endpoint)
    return endpoint.peer_id


def test_download_from_the_trainer_resume_and_cache(swarm, base, tmp_path):
    path, listing, run = base

    async def go():
        trainer = await provider(swarm[0], listing, path)
        endpoint = await swarm[2].endpoint()
        assert await fetch_model_file(endpoint, trainer, run, 10) == listing
        seen = []
        got, sources = await download(endpoint, trainer, _none, listing, Disk(tmp_path / "node", None), lambda *a: seen.append(a), 10)
        assert sha256_file(got) == listing.sha256 and got.name == f"{listing.sha256}.gguf"
        assert sources == {trainer: SIZE} and seen[-1][:2] == (SIZE, SIZE)

        # A partial file: 3 good chunks, one corrupt, the rest never written. Only the missing
        # and corrupt chunks are fetched again.
        again = Disk(tmp_path / "again", None)
        partial = again.root / "models" / f"{listing.sha256}.gguf.partial"
        partial.parent.mkdir(parents=True)
        data = bytearray(path.read_bytes()[: 4 * CHUNK])
        data[3 * CHUNK] ^= 0xFF
        partial.write_bytes(bytes(data))
        got, sources = await download(endpoint, trainer, _none, listing, again, lambda *a: None, 10)
        assert sha256_file(got) == listing.sha256 and sum(sources.values()) == SIZE - 3 * CHUNK
        assert not partial.exists()

        # A finished file is used as it is; a damaged one is repaired chunk by chunk.
        assert (await download(endpoint, trainer, _none, listing, again, lambda *a: None, 10))[1] == {}
        damaged = bytearray(got.read_bytes())
        damaged[5] ^= 1
        got.write_bytes(bytes(damaged))
        got, sources = await download(endpoint, trainer, _none, listing, again, lambda *a: None, 10)
        assert sha256_file(got) == listing.sha256 and sum(sources.values()) == CHUNK

    asyncio.run(go())


async def _none() -> list[str]:
    return []


def test_a_corrupt_peer_is_dropped_and_the_busy_trainer_points_to_honest_peers(swarm, base, tmp_path):
    path, listing, run = base

    async def go():
        # The trainer has sent its one copy and a peer holds the base: it answers "busy".
        budget = UploadBudget(copies=1)
        trainer_relay = Relay(budget=budget, peers_holding=lambda version: 1)
        trainer = await provider(swarm[0], listing, path, trainer_relay)
        budget.allow("base", "someone-else", 0.0, 0)  # the one copy went to another node
        honest = await provider(swarm[1], listing, path)
        endpoint = await swarm[2].endpoint()
        got, sources = await download(endpoint, trainer, lambda: _list([honest]), listing, Disk(tmp_path / "a", None),
                                      lambda *a: None, 10)
        assert sha256_file(got) == listing.sha256 and sources == {honest: SIZE}
        assert trainer_relay.bytes_served == 0

        # A corrupt peer's chunks are refused; the trainer (no budget now) serves what it withheld.
        trainer_relay.budget = None
        liar_dht = SwarmDHT.start("127.0.0.1", 0, initial_peers=swarm[0].addresses())
        try:
            liar = await provider(liar_dht, listing, path, Corrupt())
            got, sources = await download(endpoint, trainer, lambda: _list([liar]), listing, Disk(tmp_path / "b", None),
                                          lambda *a: None, 10)
            assert sha256_file(got) == listing.sha256 and sources == {trainer: SIZE}
        finally:
            liar_dht.shutdown()

    asyncio.run(go())


async def _list(peers):
    return peers


def test_claimed_holders_that_cannot_serve_cost_one_stall_in_a_whole_download(swarm, base, tmp_path, monkeypatch):
    """Announcements are claims: one naming a peer id that is no libp2p id, and one from a peer
    that opens the stream and never answers, are asked in the first batch only (issue 36)."""
    from echo_node import base_download, updates
    from protocols import rpc

    monkeypatch.setattr(base_download, "BATCH_CHUNKS", 2)  # 6 batches
    monkeypatch.setattr(updates, "STALL_SECONDS", 1.0)
    path, listing, run = base
    asked = []

    async def silent(request: bytes, peer: str):
        asked.append(peer)
        await asyncio.Event().wait()
        yield b""

    async def go():
        trainer = await provider(swarm[0], listing, path)
        sink = await swarm[1].endpoint()
        await sink.serve(rpc.CHUNKS, silent)
        endpoint = await swarm[2].endpoint()
        claims = ["Qm-not-base58", "1" * 46, sink.peer_id]
        got, sources = await download(endpoint, trainer, lambda: _list(claims), listing, Disk(tmp_path / "n", None),
                                      lambda *a: None, 10)
        assert sha256_file(got) == listing.sha256 and sources == {trainer: SIZE}
        assert len(asked) == 1

    asyncio.run(go())


def test_a_chunk_list_not_signed_by_the_run_key_or_for_another_base_is_refused(swarm, base, tmp_path):
    path, listing, run = base

    async def go():
        forged = model_file(path, "run-1", generate_key(), chunk_size=CHUNK)
        trainer = await provider(swarm[0], forged, path)
        endpoint = await swarm[2].endpoint()
        with pytest.raises(SignatureError):
            await fetch_model_file(endpoint, trainer, run, 10)
        other = factories.manifest(run_key=run.run_key, base_sha256=factories.SHA)
        honest = await provider(swarm[1], listing, path)
        with pytest.raises(UpdateError, match="not this run's base"):
            await fetch_model_file(endpoint, honest, other, 10)

    asyncio.run(go())


def test_progress_line():
    assert progress_line(0, 100e6, 0.0, 0) == "base model [------------------------] 0.0/100.0 MB · 0.0 MB/s"
    line = progress_line(50e6, 100e6, 5.0, 50e6)
    assert line == "base model [############------------] 50.0/100.0 MB · 10.0 MB/s · 5 s left"


def test_a_known_file_is_not_hashed_again_unless_it_changed(tmp_path, monkeypatch):
    from echo_node import base_download

    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1000)
    os.utime(model, (time.time() - 60, time.time() - 60))  # settled
    hashed = []
    monkeypatch.setattr(base_download, "sha256_file", lambda p: hashed.append(p) or sha256_file(p))
    first = base_download.known_sha256(model, tmp_path / "cache")
    assert base_download.known_sha256(model, tmp_path / "cache") == first and len(hashed) == 1
    model.write_bytes(b"y" * 1000)  # changed just now: hashed again, and not remembered while fresh
    changed = base_download.known_sha256(model, tmp_path / "cache")
    assert changed != first and base_download.known_sha256(model, tmp_path / "cache") == changed
    assert len(hashed) == 3
    (tmp_path / "cache" / "hashes.json").write_text("{not json")  # a damaged book is rebuilt
    assert base_download.known_sha256(model, tmp_path / "cache") == changed
