"""The contract between peers. Pure: msgpack, Ed25519, sha256 and numpy only.

- `errors`    typed errors for refused remote input (`ProtocolError` and its codes)
- `wire`      msgpack envelope, protocol version, size limits, field validators
- `messages`  the wire messages: RunManifest, PeerAnnouncement, TaskLease, RolloutBatch,
              WeightUpdate, Chunk, ErrorReply
- `signing`   Ed25519 keys, fingerprints, canonical signatures, sha256 content hashes
- `delta`     weight-update codec (dense / top-k int8) with error feedback
- `chunks`    content-addressed chunking of update payloads
- `catchup`   the cheapest chain of updates (deltas, snapshots) from one version to another
- `uploads`   the trainer's upload budget: how much of an update it sends before peers relay it
- `sync`      lease book, staleness gate, acceptance rule and replay buffer, as pure state machines
- `transport` the hivemind adapter (DHT records, streams); the only importer of hivemind and
              never imported from here, so `import protocols` stays light.
"""

from protocols.errors import EchoError, ProtocolError
from protocols.wire import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "EchoError", "ProtocolError"]
