"""Every message that crosses a process boundary, in one package.

- `run`      RunManifest (+ TaskSpec, TurnFormat), HoldersRequest/Holders, ReachRequest/Reply, ErrorReply:
             what a run is, who holds a version, who can be dialled
- `work`     LeaseRequest, TaskLease, NoWork, RolloutBatch (+ RolloutSample, Segment), PushReceipt
- `updates`  WeightUpdate (+ TensorEntry), ModelFile, UpdateRequest, UpdateIndex, ChunkRequest, Chunk

Frozen dataclasses; `to_wire()` / `Cls.from_wire(data)` (see `wire.WireMessage`). Bodies ignore
unknown fields and reject wrong types, missing fields and out-of-limit values with a typed
`ProtocolError`. Signed messages carry `signature` last; see `signing.sign_message`.

Who signs what: the run key signs RunManifest, WeightUpdate and ModelFile; a node's own key signs its
LeaseRequest and RolloutBatch (the key travels in the message and the node is
known by its fingerprint, so credit and bans follow the key, not a claimed name).
"""

from protocols.messages.run import (
    HARDWARE_CHARS, MAX_ADDRS, MAX_HOLDERS, MAX_SAMPLE_TOKENS, MAX_TURNS, MODES, UPDATE_MODES, ErrorReply, Holders,
    HoldersRequest, ReachReply, ReachRequest, RunManifest, TaskSpec, TurnFormat,
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
    "HARDWARE_CHARS", "MAX_ADDRS", "MAX_BATCH_TOKENS", "MAX_HOLDERS", "MAX_CHUNK_BYTES", "MAX_SAMPLES", "MAX_SAMPLE_TOKENS", "MAX_SEEDS", "MAX_TENSORS",
    "MAX_TURNS", "MODES", "SEGMENT_ROLES", "UPDATE_MODES", "Chunk", "ChunkRequest", "ErrorReply", "Holders", "HoldersRequest", "LeaseRequest",
    "ModelFile", "NoWork", "PushReceipt", "ReachReply", "ReachRequest", "RolloutBatch", "RolloutSample", "RunManifest", "Segment", "TaskLease", "TaskSpec",
    "TensorEntry", "TurnFormat", "UpdateIndex", "UpdateInfo", "UpdateRequest", "WeightUpdate",
]
