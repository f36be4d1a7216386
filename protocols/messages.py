"""Every message that crosses a process boundary, in one place.

Frozen dataclasses; `to_wire()` / `Cls.from_wire(data)` (see `wire.WireMessage`). Bodies ignore
unknown fields and reject wrong types, missing fields and out-of-limit values with a typed
`ProtocolError`. Signed messages carry `signature` last; see `signing.sign_message`.

Who signs what: the run key signs RunManifest and WeightUpdate; a node's own key signs its
PeerAnnouncement and RolloutBatch (the key travels in the message and the node is known by its
fingerprint, so credit and bans follow the key, not a claimed name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols.errors import InvalidValue, MalformedMessage, MessageTooLarge, ProtocolError
from protocols.signing import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, fingerprint, verify_message
from protocols.wire import Fields, WireMessage, array_bytes, scalar

MODES = ("sequential", "async")
UPDATE_MODES = ("lora", "full")
ROLES = ("node", "trainer")
SEGMENT_ROLES = ("model", "env")  # only "model" tokens are trained (loss mask 1)

MAX_SAMPLES = 4096  # per RolloutBatch
MAX_SAMPLE_TOKENS = 32768  # prompt + completion, per sample
MAX_BATCH_TOKENS = 2**22  # all samples of one batch
MAX_SEEDS = 4096  # per TaskLease
MAX_TENSORS = 20_000  # per WeightUpdate
MAX_CHUNK_BYTES = 8 * 2**20
MAX_PARAMS = 64  # free-form parameter maps (task, update)
MAX_ADDRS = 16

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _sha256_field(f: Fields, name: str) -> str:
    value = f.text(name, 64)
    if not _SHA256.fullmatch(value):
        raise InvalidValue(f"{f.where}.{name}: {value!r} is not a lowercase hex sha256")
    return value


def _params(f: Fields, name: str) -> dict[str, Any]:
    params = {}
    for key, value in f.mapping(name, MAX_PARAMS).items():
        if not isinstance(key, str) or len(key) > 64:
            raise MalformedMessage(f"{f.where}.{name}: keys must be strings of at most 64 characters")
        params[key] = scalar(value, f"{f.where}.{name}.{key}")
    return params


def _signature(f: Fields) -> bytes:
    return f.blob("signature", SIGNATURE_BYTES) if f.has("signature") else b""


@dataclass(frozen=True)
class TaskSpec:
    """Which environment a run trains on, and its generator parameters (difficulty, ...)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, body: Any) -> TaskSpec:
        f = Fields(body, "task")
        return cls(name=f.text("name"), params=_params(f, "params"))


@dataclass(frozen=True)
class RunManifest(WireMessage):
    """What a run is. Stored in the DHT, signed by the run key; nodes pin its fingerprint."""

    KIND = "run_manifest"
    MAX_BYTES = 64 * 1024

    run_id: str
    base_model: str  # file name, for humans
    base_sha256: str  # the base model file's sha256: version 0
    vocab_size: int
    mode: str  # one of MODES
    update: str  # one of UPDATE_MODES
    staleness: int  # S: the trainer accepts rollouts of version >= current - S
    task: TaskSpec
    group_size: int  # completions per prompt (GRPO group)
    max_new_tokens: int
    temperature: float  # nodes sample at exactly this temperature, no top-k/top-p truncation
    run_key: bytes  # Ed25519 public key that signs this manifest and every WeightUpdate
    trainer_addrs: tuple[str, ...]
    update_params: dict[str, Any] = field(default_factory=dict)  # e.g. LoRA rank and alpha
    created: float = 0.0
    signature: bytes = b""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "base_model": self.base_model, "base_sha256": self.base_sha256,
            "vocab_size": self.vocab_size, "mode": self.mode, "update": self.update,
            "staleness": self.staleness, "task": self.task.to_dict(), "group_size": self.group_size,
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
            "run_key": self.run_key, "trainer_addrs": list(self.trainer_addrs),
            "update_params": dict(self.update_params), "created": self.created, "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> RunManifest:
        f = Fields(body, cls.KIND)
        return cls(
            run_id=f.text("run_id"), base_model=f.text("base_model"), base_sha256=_sha256_field(f, "base_sha256"),
            vocab_size=f.integer("vocab_size", 1, 2**24), mode=f.text("mode", choices=MODES),
            update=f.text("update", choices=UPDATE_MODES), staleness=f.integer("staleness", 1, 1000),
            task=TaskSpec.from_dict(f.mapping("task", 2)), group_size=f.integer("group_size", 1, 256),
            max_new_tokens=f.integer("max_new_tokens", 1, MAX_SAMPLE_TOKENS),
            temperature=f.number("temperature", 1e-3, 100.0),
            run_key=f.blob("run_key", PUBLIC_KEY_BYTES, exact=PUBLIC_KEY_BYTES),
            trainer_addrs=tuple(f.texts("trainer_addrs", MAX_ADDRS, 512)),
            update_params=_params(f, "update_params"), created=f.number("created", 0.0),
            signature=_signature(f),
        )


@dataclass(frozen=True)
class PeerAnnouncement(WireMessage):
    """A peer's self-description in the DHT, refreshed before its TTL runs out; signed by the peer."""

    KIND = "peer_announcement"
    MAX_BYTES = 8 * 1024

    peer_id: str  # hivemind/libp2p peer id (base58), where to open streams
    name: str  # public display name chosen by the volunteer
    role: str  # one of ROLES
    backend: str  # "llama_cpp", "transformers", "torch" (trainer)
    model_sha256: str
    version: int  # policy version the peer holds
    throughput: float  # generated tokens per second, recent average
    public_key: bytes
    time: float
    signature: bytes = b""

    @property
    def node_id(self) -> str:
        return fingerprint(self.public_key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id, "name": self.name, "role": self.role, "backend": self.backend,
            "model_sha256": self.model_sha256, "version": self.version, "throughput": self.throughput,
            "public_key": self.public_key, "time": self.time, "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> PeerAnnouncement:
        f = Fields(body, cls.KIND)
        return cls(
            peer_id=f.text("peer_id"), name=f.text("name", 64), role=f.text("role", choices=ROLES),
            backend=f.text("backend", 32), model_sha256=_sha256_field(f, "model_sha256"),
            version=f.integer("version"), throughput=f.number("throughput", 0.0),
            public_key=f.blob("public_key", PUBLIC_KEY_BYTES, exact=PUBLIC_KEY_BYTES),
            time=f.number("time", 0.0), signature=_signature(f),
        )


def verified_announcements(records: Any) -> list[PeerAnnouncement]:
    """The announcements among DHT records ({subkey: bytes}) that parse and verify against their
    own key. The DHT is open to anyone: tombstones (withdrawn peers) and junk are skipped."""
    found = []
    for value in records.values() if isinstance(records, dict) else ():
        try:
            announcement = PeerAnnouncement.from_wire(value)
            verify_message(announcement, announcement.public_key)
        except ProtocolError:
            continue
        found.append(announcement)
    return found


@dataclass(frozen=True)
class LeaseRequest(WireMessage):
    """A node asking for work; signed by the node so nobody can take leases in its name."""

    KIND = "lease_request"
    MAX_BYTES = 8 * 1024

    run_id: str
    node_key: bytes
    peer_id: str
    name: str
    version: int  # policy version the node holds
    max_seeds: int
    time: float  # node clock; bounds replay of an old request
    signature: bytes = b""

    @property
    def node_id(self) -> str:
        return fingerprint(self.node_key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "node_key": self.node_key, "peer_id": self.peer_id, "name": self.name,
            "version": self.version, "max_seeds": self.max_seeds, "time": self.time, "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> LeaseRequest:
        f = Fields(body, cls.KIND)
        return cls(
            run_id=f.text("run_id"), node_key=f.blob("node_key", PUBLIC_KEY_BYTES, exact=PUBLIC_KEY_BYTES),
            peer_id=f.text("peer_id"), name=f.text("name", 64), version=f.integer("version"),
            max_seeds=f.integer("max_seeds", 1, MAX_SEEDS), time=f.number("time", 0.0), signature=_signature(f),
        )


@dataclass(frozen=True)
class TaskLease(WireMessage):
    """Task seeds handed to one node, single-use, until `expires_at` (trainer clock, unix seconds).

    The trainer renders each seed's prompt itself and sends the token ids, so every backend
    samples from exactly the prompt the trainer will train on (no template or tokenizer drift)."""

    KIND = "task_lease"
    MAX_BYTES = 4 * 2**20

    lease_id: str
    run_id: str
    node_id: str  # fingerprint of the node key the lease is for
    seeds: tuple[int, ...]
    prompts: tuple[tuple[int, ...], ...]  # prompt token ids, one per seed
    version: int  # sequential: the version to generate with; async: trainer version at issue
    expires_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id, "run_id": self.run_id, "node_id": self.node_id,
            "seeds": array_bytes(self.seeds, "<u8"), "prompts": [array_bytes(p, "<i4") for p in self.prompts],
            "version": self.version, "expires_at": self.expires_at,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> TaskLease:
        f = Fields(body, cls.KIND)
        seeds = tuple(int(s) for s in f.array("seeds", "<u8", MAX_SEEDS))
        raw_prompts = f.items("prompts", MAX_SEEDS)
        if len(raw_prompts) != len(seeds):
            raise InvalidValue(f"{cls.KIND}: {len(raw_prompts)} prompts for {len(seeds)} seeds")
        prompts = []
        for i, raw in enumerate(raw_prompts):
            ids = Fields({"p": raw}, f"{cls.KIND}.prompts[{i}]").array("p", "<i4", MAX_SAMPLE_TOKENS)
            if len(ids) == 0 or (ids < 0).any():
                raise InvalidValue(f"{cls.KIND}.prompts[{i}]: empty or negative token ids")
            prompts.append(tuple(ids.tolist()))
        return cls(
            lease_id=f.text("lease_id"), run_id=f.text("run_id"), node_id=f.text("node_id"), seeds=seeds,
            prompts=tuple(prompts), version=f.integer("version"), expires_at=f.number("expires_at", 0.0),
        )


@dataclass(frozen=True)
class NoWork(WireMessage):
    """The answer to a LeaseRequest when nothing is pending: ask again after `retry_after` s."""

    KIND = "no_work"
    MAX_BYTES = 1024

    latest_version: int
    retry_after: float
    finished: bool = False  # the run is over: stop asking

    def to_dict(self) -> dict[str, Any]:
        return {"latest_version": self.latest_version, "retry_after": self.retry_after, "finished": self.finished}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> NoWork:
        f = Fields(body, cls.KIND)
        return cls(f.integer("latest_version"), f.number("retry_after", 0.0, 3600.0), f.flag("finished"))


@dataclass(frozen=True)
class PushReceipt(WireMessage):
    """The trainer's answer to a RolloutBatch: how many samples it accepted and why not the rest."""

    KIND = "push_receipt"
    MAX_BYTES = 16 * 1024

    accepted: int
    rejected: int
    reasons: dict[str, Any] = field(default_factory=dict)  # reason code -> sample count
    latest_version: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "rejected": self.rejected, "reasons": dict(self.reasons),
                "latest_version": self.latest_version}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> PushReceipt:
        f = Fields(body, cls.KIND)
        return cls(f.integer("accepted"), f.integer("rejected"), _params(f, "reasons"), f.integer("latest_version"))


@dataclass(frozen=True)
class Segment:
    """A run of completion tokens written by one side of a multi-turn episode."""

    role: str  # one of SEGMENT_ROLES
    length: int


@dataclass(frozen=True)
class RolloutSample:
    """One completion. Behaviour logprobs are per completion token, under the distribution the
    node actually sampled from (its weights, the run's temperature). Env-written tokens carry
    logprob 0 and loss mask 0."""

    seed: int  # task seed: the trainer regenerates the task and recomputes the reward from it
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    segments: tuple[Segment, ...] = ()  # empty means one "model" segment covering the completion

    @property
    def loss_mask(self) -> tuple[int, ...]:
        if not self.segments:
            return (1,) * len(self.completion_ids)
        return tuple(int(s.role == "model") for s in self.segments for _ in range(s.length))

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "prompt_ids": array_bytes(self.prompt_ids, "<i4"),
            "completion_ids": array_bytes(self.completion_ids, "<i4"), "logprobs": array_bytes(self.logprobs, "<f4"),
            "segments": [[s.role, s.length] for s in self.segments],
        }

    @classmethod
    def from_dict(cls, body: Any, where: str) -> RolloutSample:
        f = Fields(body, where)
        prompt = f.array("prompt_ids", "<i4", MAX_SAMPLE_TOKENS)
        completion = f.array("completion_ids", "<i4", MAX_SAMPLE_TOKENS)
        logprobs = f.array("logprobs", "<f4", MAX_SAMPLE_TOKENS)
        if len(prompt) + len(completion) > MAX_SAMPLE_TOKENS:
            raise MessageTooLarge(f"{where}: {len(prompt) + len(completion)} tokens exceeds {MAX_SAMPLE_TOKENS}")
        if len(completion) == 0 or len(prompt) == 0:
            raise InvalidValue(f"{where}: empty prompt or completion")
        if len(logprobs) != len(completion):
            raise InvalidValue(f"{where}: {len(logprobs)} logprobs for {len(completion)} completion tokens")
        if (prompt < 0).any() or (completion < 0).any():
            raise InvalidValue(f"{where}: negative token id")
        if not np.isfinite(logprobs).all():
            raise InvalidValue(f"{where}: logprobs contain NaN or infinity")
        if (logprobs > 1e-4).any():  # a log-probability is <= 0; allow float rounding
            raise InvalidValue(f"{where}: positive logprob {float(logprobs.max())}")
        segments = []
        for i, raw in enumerate(f.items("segments", MAX_SAMPLE_TOKENS)):
            if not (isinstance(raw, list) and len(raw) == 2):
                raise MalformedMessage(f"{where}.segments[{i}]: expected a [role, length] pair")
            s = Fields({"role": raw[0], "length": raw[1]}, f"{where}.segments[{i}]")
            segments.append(Segment(s.text("role", choices=SEGMENT_ROLES), s.integer("length", 1, MAX_SAMPLE_TOKENS)))
        if segments and sum(s.length for s in segments) != len(completion):
            raise InvalidValue(f"{where}: segments cover {sum(s.length for s in segments)} of {len(completion)} tokens")
        return cls(
            seed=f.integer("seed"), prompt_ids=tuple(prompt.tolist()), completion_ids=tuple(completion.tolist()),
            logprobs=tuple(logprobs.tolist()), segments=tuple(segments),
        )


@dataclass(frozen=True)
class RolloutBatch(WireMessage):
    """A node's completions for one lease, generated with policy `version`; signed by the node."""

    KIND = "rollout_batch"

    run_id: str
    lease_id: str
    version: int
    node_key: bytes
    samples: tuple[RolloutSample, ...]
    created: float = 0.0
    signature: bytes = b""

    @property
    def node_id(self) -> str:
        return fingerprint(self.node_key)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.samples)

    def check_vocab(self, vocab_size: int) -> None:
        for i, s in enumerate(self.samples):
            top = max(max(s.prompt_ids), max(s.completion_ids))
            if top >= vocab_size:
                raise InvalidValue(f"{self.KIND}.samples[{i}]: token id {top} outside vocab of {vocab_size}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "lease_id": self.lease_id, "version": self.version, "node_key": self.node_key,
            "samples": [s.to_dict() for s in self.samples], "created": self.created, "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> RolloutBatch:
        f = Fields(body, cls.KIND)
        raw_samples = f.items("samples", MAX_SAMPLES)
        samples = tuple(RolloutSample.from_dict(s, f"{cls.KIND}.samples[{i}]") for i, s in enumerate(raw_samples))
        total = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        if total > MAX_BATCH_TOKENS:
            raise MessageTooLarge(f"{cls.KIND}: {total} tokens exceeds {MAX_BATCH_TOKENS}")
        if not samples:
            raise InvalidValue(f"{cls.KIND}: no samples")
        return cls(
            run_id=f.text("run_id"), lease_id=f.text("lease_id"), version=f.integer("version"),
            node_key=f.blob("node_key", PUBLIC_KEY_BYTES, exact=PUBLIC_KEY_BYTES), samples=samples,
            created=f.number("created", 0.0), signature=_signature(f),
        )

    @classmethod
    def from_wire(cls, data: bytes, vocab_size: int | None = None) -> RolloutBatch:
        batch = super().from_wire(data)
        if vocab_size is not None:
            batch.check_vocab(vocab_size)
        return batch


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a WeightUpdate: its payload is split into chunks addressed by sha256."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # dtype of the weights the payload updates, e.g. "float32"
    encoding: str  # delta codec encoding, e.g. "dense-fp32", "topk-int8"
    nbytes: int  # payload size; every chunk but the last is exactly the update's chunk_size
    chunks: tuple[str, ...]  # sha256 hex of each chunk, in order

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "shape": list(self.shape), "dtype": self.dtype, "encoding": self.encoding,
            "nbytes": self.nbytes, "chunks": list(self.chunks),
        }

    @classmethod
    def from_dict(cls, body: Any, where: str, chunk_size: int) -> TensorEntry:
        f = Fields(body, where)
        shape = tuple(f.integers("shape", 8, 0, 2**31))
        nbytes = f.integer("nbytes", 0, 2**40)
        chunks = tuple(f.texts("chunks", 2**20, 64))
        if not all(_SHA256.fullmatch(c) for c in chunks):
            raise InvalidValue(f"{where}.chunks: every chunk must be named by its lowercase hex sha256")
        if len(chunks) != -(-nbytes // chunk_size):
            raise InvalidValue(f"{where}: {len(chunks)} chunks cannot hold {nbytes} bytes at {chunk_size} per chunk")
        return cls(
            name=f.text("name"), shape=shape, dtype=f.text("dtype", 16), encoding=f.text("encoding", 32),
            nbytes=nbytes, chunks=chunks,
        )


@dataclass(frozen=True)
class WeightUpdate(WireMessage):
    """Manifest of the step from `from_version` to `to_version`, signed by the run key. Nodes
    verify it before fetching any chunk."""

    KIND = "weight_update"
    MAX_BYTES = 16 * 2**20

    run_id: str
    from_version: int
    to_version: int
    mode: str  # one of UPDATE_MODES
    tensors: tuple[TensorEntry, ...]
    chunk_size: int
    replaces: bool = False  # True: payloads are the weights themselves (snapshot, LoRA adapter), not deltas
    params: dict[str, Any] = field(default_factory=dict)  # e.g. LoRA alpha
    created: float = 0.0
    signature: bytes = b""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "from_version": self.from_version, "to_version": self.to_version,
            "mode": self.mode, "tensors": [t.to_dict() for t in self.tensors], "chunk_size": self.chunk_size,
            "replaces": self.replaces,
            "params": dict(self.params), "created": self.created, "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> WeightUpdate:
        f = Fields(body, cls.KIND)
        from_version, to_version = f.integer("from_version"), f.integer("to_version")
        if to_version <= from_version:
            raise InvalidValue(f"{cls.KIND}: to_version {to_version} is not after from_version {from_version}")
        chunk_size = f.integer("chunk_size", 1, MAX_CHUNK_BYTES)
        tensors = tuple(
            TensorEntry.from_dict(t, f"{cls.KIND}.tensors[{i}]", chunk_size)
            for i, t in enumerate(f.items("tensors", MAX_TENSORS))
        )
        if len({t.name for t in tensors}) != len(tensors):
            raise InvalidValue(f"{cls.KIND}: duplicate tensor names")
        return cls(
            run_id=f.text("run_id"), from_version=from_version, to_version=to_version,
            mode=f.text("mode", choices=UPDATE_MODES), tensors=tensors, chunk_size=chunk_size, replaces=f.flag("replaces"),
            params=_params(f, "params"), created=f.number("created", 0.0), signature=_signature(f),
        )


@dataclass(frozen=True)
class UpdateRequest(WireMessage):
    """Ask a provider for the WeightUpdate manifest of one step `from_version -> to_version`."""

    KIND = "update_request"
    MAX_BYTES = 1024

    from_version: int
    to_version: int

    def to_dict(self) -> dict[str, Any]:
        return {"from_version": self.from_version, "to_version": self.to_version}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> UpdateRequest:
        f = Fields(body, cls.KIND)
        return cls(f.integer("from_version"), f.integer("to_version"))


@dataclass(frozen=True)
class UpdateInfo:
    from_version: int
    to_version: int
    nbytes: int  # payload bytes to fetch
    replaces: bool  # a snapshot (or LoRA adapter): applies from any version


@dataclass(frozen=True)
class UpdateIndex(WireMessage):
    """Which updates a provider can serve. A hint for planning: every manifest is still verified."""

    KIND = "update_index"
    MAX_BYTES = 256 * 1024

    latest_version: int
    updates: tuple[UpdateInfo, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"latest_version": self.latest_version,
                "updates": [[u.from_version, u.to_version, u.nbytes, u.replaces] for u in self.updates]}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> UpdateIndex:
        f = Fields(body, cls.KIND)
        updates = []
        for i, raw in enumerate(f.items("updates", 8192)):
            if not (isinstance(raw, list) and len(raw) == 4):
                raise MalformedMessage(f"{cls.KIND}.updates[{i}]: expected [from, to, nbytes, replaces]")
            u = Fields(dict(zip(("from", "to", "nbytes", "replaces"), raw)), f"{cls.KIND}.updates[{i}]")
            updates.append(UpdateInfo(u.integer("from"), u.integer("to"), u.integer("nbytes"), u.flag("replaces")))
        return cls(f.integer("latest_version"), tuple(updates))


@dataclass(frozen=True)
class ChunkRequest(WireMessage):
    """Ask a provider for chunks by digest; it streams back one Chunk per digest it holds."""

    KIND = "chunk_request"
    MAX_BYTES = 1024 * 1024

    digests: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"digests": list(self.digests)}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ChunkRequest:
        f = Fields(body, cls.KIND)
        digests = tuple(f.texts("digests", 10_000, 64))
        if not all(_SHA256.fullmatch(d) for d in digests):
            raise InvalidValue(f"{cls.KIND}.digests: every digest must be a lowercase hex sha256")
        return cls(digests)


@dataclass(frozen=True)
class Chunk(WireMessage):
    """A content-addressed piece of a tensor payload. Receivers check sha256(data) == digest."""

    KIND = "chunk"
    MAX_BYTES = MAX_CHUNK_BYTES + 1024

    digest: str
    data: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "data": self.data}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Chunk:
        f = Fields(body, cls.KIND)
        return cls(digest=_sha256_field(f, "digest"), data=f.blob("data", MAX_CHUNK_BYTES))


@dataclass(frozen=True)
class ErrorReply(WireMessage):
    """What a handler sends back instead of a result: a ProtocolError code and a message."""

    KIND = "error"
    MAX_BYTES = 16 * 1024

    code: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message[:4096]}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ErrorReply:
        f = Fields(body, cls.KIND)
        return cls(code=f.text("code", 64), message=f.text("message", 4096))
