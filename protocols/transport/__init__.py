"""The hivemind adapter: the only code that imports hivemind. Not imported by `protocols`.

- `streams`  framed request/reply streams over libp2p with size limits, timeouts and typed
             remote errors (`Endpoint.serve` / `Endpoint.call`)
- `dht`      the swarm's DHT: the run manifest, the latest version and peer announcements,
             all small signed msgpack records keyed by the run key's fingerprint
"""
