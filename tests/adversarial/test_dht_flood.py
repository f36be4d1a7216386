"""A flood of valid announcements from fresh keys (keys are free) into the run's peers record,
over a real DHT: every replica keeps at most MAX_SUBKEYS of them, so memory and what a reader
fetches and verifies stay bounded whatever the attacker spends."""

import asyncio
import time

from protocols.messages import PeerAnnouncement, verified_announcements
from protocols.signing import fingerprint, generate_key, public_bytes, sign_message
from protocols.transport import dht as dht_module
from protocols.transport.dht import SwarmDHT, record_key
from tests.unit.protocols.factories import peer_id


def test_the_peers_record_holds_a_bounded_number_of_announcements(monkeypatch):
    monkeypatch.setattr(dht_module, "MAX_SUBKEYS", 16)  # before the DHT processes fork: they hold it too
    run_fp = fingerprint(public_bytes(generate_key()))
    replica = SwarmDHT.start("127.0.0.1", 0, run_fingerprint=run_fp)
    attacker = SwarmDHT.start("127.0.0.1", 0, replica.addresses(), run_fingerprint=run_fp)
    key = record_key(run_fp, "peers")

    async def flood():
        for i in range(40):
            fresh = generate_key()
            announcement = sign_message(PeerAnnouncement(
                peer_id(f"Flood{i}"), f"flood-{i}", "node", "llama_cpp", "ab" * 32, 0, 0.0, public_bytes(fresh),
                time.time(), run_id="run-1"), fresh)
            await attacker.put(key, announcement.to_wire(), 120, subkey=announcement.node_id)
        return await replica.get(key), await attacker.get(key)

    try:
        held, fetched = asyncio.run(flood())
    finally:
        attacker.shutdown()
        replica.shutdown()
    assert 0 < len(held) <= 16 and 0 < len(fetched) <= 16
    assert len(verified_announcements(held, "run-1")) == len(held)  # valid, each of them: only the cap stops them
