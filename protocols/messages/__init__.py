"""Every message that crosses a process boundary, in one package.

- `run`      RunManifest (+ TaskSpec, TurnFormat), PeerAnnouncement, ReachRequest/Reply, ErrorReply: what a
             run is, who is in it, who can be dialled
- `work`     LeaseRequest, TaskLease, NoWork, RolloutBatch (+ RolloutSample, Segment), PushReceipt
- `updates`  WeightUpdate (+ TensorEntry), ModelFile, UpdateRequest, UpdateIndex, ChunkRequest, Chunk

Frozen dataclasses; `to_wire()` / `Cls.from_wire(data)` (see `wire.WireMessage`). Bodies ignore
unknown fields and reject wrong types, missing fields and out-of-limit values with a typed
`ProtocolError`. Signed messages carry `signature` last; see `signing.sign_message`.

Who signs what: the run key signs RunManifest, WeightUpdate and ModelFile; a node's own key signs its
PeerAnnouncement, LeaseRequest and RolloutBatch (the key travels in the message and the node is
known by its fingerprint, so credit and bans follow the key, not a claimed name).
"""

from protocols.messages.run import (
    HARDWARE_CHARS, MAX_ADDRS, MAX_SAMPLE_TOKENS, MAX_TURNS, MODES, ROLES, UPDATE_MODES, ErrorReply, PeerAnnouncement, ReachReply,
    ReachRequest, RunManifest, TaskSpec, TurnFormat, verified_announcements,
)
from protocols.messages.updates import (
    MAX_CHUNK_BYTES, MAX_TENSORS, Chunk, ChunkRequest, ModelFile, TensorEntry, UpdateIndex, UpdateInfo, UpdateRequest,
    WeightUpdate,
)
from protocols.messages.work import (
    MAX_BATCH_TOKENS, MAX_SAMPLES, MAX_SEEDS, SEGMENT_ROLES, LeaseRequest, NoWork, PushReceipt, RolloutBatch,
    RolloutSample, Segment, TaskLease,
)

__all__ = [
    "HARDWARE_CHARS", "MAX_ADDRS", "MAX_BATCH_TOKENS", "MAX_CHUNK_BYTES", "MAX_SAMPLES", "MAX_SAMPLE_TOKENS", "MAX_SEEDS", "MAX_TENSORS",
    "MAX_TURNS", "MODES", "ROLES", "SEGMENT_ROLES", "UPDATE_MODES", "Chunk", "ChunkRequest", "ErrorReply", "LeaseRequest",
    "ModelFile", "NoWork", "PeerAnnouncement", "PushReceipt", "ReachReply", "ReachRequest", "RolloutBatch", "RolloutSample", "RunManifest", "Segment", "TaskLease", "TaskSpec",
    "TensorEntry", "TurnFormat", "UpdateIndex", "UpdateInfo", "UpdateRequest", "WeightUpdate", "verified_announcements",
]
