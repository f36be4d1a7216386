"""A flood of records from fresh keys (keys are free) into the run's namespace of a real DHT: the
run's one record is its manifest, so every replica refuses the rest, signed or not, and a flood
costs the swarm no memory and no reader anything (nodes once announced themselves in a `peers`
record that any fresh key could fill: docs/scaling.md)."""

import asyncio

from protocols.messages import LeaseRequest
from protocols.signing import fingerprint, generate_key, public_bytes, sign_message
from protocols.transport.dht import SwarmDHT, record_key
from tests.unit.protocols.factories import peer_id


def test_records_other_than_the_manifest_are_refused_by_every_replica():
    run_fp = fingerprint(public_bytes(generate_key()))
    replica = SwarmDHT.start("127.0.0.1", 0, run_fingerprint=run_fp)
    attacker = SwarmDHT.start("127.0.0.1", 0, replica.addresses())  # no validator: it stores what it likes

    async def flood():
        for i in range(20):
            fresh = generate_key()
            signed = sign_message(LeaseRequest("run-1", public_bytes(fresh), peer_id(f"Flood{i}"), f"flood-{i}",
                                               0, 8, 0.0), fresh)
            await attacker.put(record_key(run_fp, "peers"), signed.to_wire(), 120, subkey=fingerprint(public_bytes(fresh)))
            await attacker.put(record_key(run_fp, f"peers-{i}"), signed.to_wire(), 120)
        # The replica's view: what it stored, and what it accepts of the attacker's own store.
        return await replica.get(record_key(run_fp, "peers")), await replica.get(record_key(run_fp, "peers-0"))

    try:
        peers, other = asyncio.run(flood())
    finally:
        attacker.shutdown()
        replica.shutdown()
    assert not peers and not other
