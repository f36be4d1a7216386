"""The hivemind adapter: the only code that imports hivemind (`relay` needs none, so the
coordinator's service can use it without a network). Not imported by `protocols`.

- `streams`  framed request/reply streams over libp2p with size limits, timeouts and typed
             remote errors (`Endpoint.serve` / `Endpoint.call`)
- `relay`    serves verified updates (manifests, index, chunks); the trainer's and every node's
- `dht`      the swarm's DHT: the run manifest, a small signed record keyed by the run key's
             fingerprint, and the libp2p daemon every stream goes through
"""
