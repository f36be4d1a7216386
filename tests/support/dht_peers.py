"""More public peers for a test swarm: `python -m tests.support.dht_peers HOST JOIN_ADDRESS RUN_FP N`
starts N DHT peers at HOST (reachable, so each runs libp2p's relay service, as the coordinator
does), joined to the swarm at JOIN_ADDRESS, and keeps them until it is stopped.

Why a test wants them: a peer behind NAT makes its relay reservation within seconds once it knows
4 peers that can relay, and only after libp2p's 3-minute boot delay while it knows fewer (measured:
one known relay, 150 s and more; four, 3-10 s). A real swarm has public nodes besides the
coordinator; these stand in for them, so the NAT test does not spend 3 minutes waiting."""

import signal
import sys
import threading

from protocols.transport.dht import SwarmDHT

if __name__ == "__main__":
    host, address, run_fp, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    peers = [SwarmDHT.start(host, 0, [address], run_fingerprint=run_fp, public=True) for _ in range(count)]
    print("ready", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    for peer in peers:
        peer.shutdown()
