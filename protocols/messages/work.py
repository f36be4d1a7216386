"""The work cycle: lease requests and leases, rollout batches, and the trainer's receipts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols.errors import InvalidValue, MalformedMessage, MessageTooLarge
from protocols.messages.run import HARDWARE_CHARS, MAX_SAMPLE_TOKENS
from protocols.signing import PUBLIC_KEY_BYTES, fingerprint, verify_body
from protocols.wire import Fields, WireMessage, array_bytes, unpack

SEGMENT_ROLES = ("model", "env")  # only "model" tokens are trained (loss mask 1)
MAX_SAMPLES = 4096  # per RolloutBatch
MAX_BATCH_TOKENS = 2**22  # all samples of one batch
MAX_SEEDS = 4096  # per TaskLease
MAX_EVAL_SAMPLES = 256  # completions per prompt an evaluation lease may ask for
MAX_PARALLEL = 1024  # sequences a node may say it decodes at once


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
    backend: str = ""  # what the node samples with, e.g. "llama.cpp Q4_1": shown on the dashboard, never trusted
    parallel: int = 1  # sequences the node decodes at once; leases are sized to fill them (`Leasing`)
    update_failed: bool = False  # it could not update past `version` (`protocols.sync.lease_version`)
    hardware: str = ""  # what it runs on ("x86_64, 8 cores, 31 GiB RAM, CPU only"): shown on the dashboard

    @property
    def node_id(self) -> str:
        return fingerprint(self.node_key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "node_key": self.node_key, "peer_id": self.peer_id, "name": self.name,
            "version": self.version, "max_seeds": self.max_seeds, "time": self.time, "signature": self.signature,
            **({"backend": self.backend} if self.backend else {}),  # optional: older nodes signed without it
            **({"parallel": self.parallel} if self.parallel != 1 else {}),  # the same
            **({"update_failed": True} if self.update_failed else {}),
            **({"hardware": self.hardware} if self.hardware else {}),
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> LeaseRequest:
        f = Fields(body, cls.KIND)
        return cls(
            run_id=f.text("run_id"), node_key=f.blob("node_key", PUBLIC_KEY_BYTES, exact=PUBLIC_KEY_BYTES),
            peer_id=f.peer_id("peer_id"), name=f.text("name", 64), version=f.integer("version"),
            max_seeds=f.integer("max_seeds", 1, MAX_SEEDS), time=f.number("time", 0.0), signature=f.signature(),
            backend=f.text("backend", 64) if f.has("backend") else "",
            parallel=f.integer("parallel", 1, MAX_PARALLEL) if f.has("parallel") else 1,
            update_failed=f.flag("update_failed") if f.has("update_failed") else False,
            hardware=f.text("hardware", HARDWARE_CHARS) if f.has("hardware") else "",
        )


@dataclass(frozen=True)
class TaskLease(WireMessage):
    """Task seeds handed to one node, single-use, until `expires_at` (trainer clock, unix seconds).

    The trainer renders each seed's prompt itself and sends the token ids, so every backend
    samples from exactly the prompt the trainer will train on (no template or tokenizer drift).

    An evaluation lease (`evaluation`) asks for `samples` completions per prompt at exactly
    `version`, greedy or sampled; they are scored for held-out accuracy and never trained on."""

    KIND = "task_lease"
    MAX_BYTES = 4 * 2**20 - 64 * 1024  # (a unary call's reply: `rpc.UNARY_MAX_BYTES`)

    lease_id: str
    run_id: str
    node_id: str  # fingerprint of the node key the lease is for
    seeds: tuple[int, ...]
    prompts: tuple[tuple[int, ...], ...]  # prompt token ids, one per seed
    version: int  # sequential: the version to generate with; async: trainer version at issue
    expires_at: float
    evaluation: bool = False
    samples: int = 0  # evaluation: completions per prompt (training leases: the run's group size)
    greedy: bool = False  # evaluation: argmax decoding instead of the lease's noise
    # What the sampling noise derives from (`protocols.sampling.sample_seeds`), if not the lease id:
    # the run's for a training lease (`sampling.TRAINING_NOISE`) or a sampled evaluation round's, so
    # that a seed one node abandons and another answers is sampled with the same noise; otherwise
    # leaving the seeds that scored badly re-rolls them.
    noise: str = ""

    @property
    def noise_id(self) -> str:
        return self.noise or self.lease_id

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id, "run_id": self.run_id, "node_id": self.node_id,
            "seeds": array_bytes(self.seeds, "<u8"), "prompts": [array_bytes(p, "<i4") for p in self.prompts],
            "version": self.version, "expires_at": self.expires_at,
            # optional: a training lease reads as it always did
            **({"evaluation": True, "samples": self.samples, "greedy": self.greedy} if self.evaluation else {}),
            **({"noise": self.noise} if self.noise else {}),
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
            **(dict(evaluation=True, samples=f.integer("samples", 1, MAX_EVAL_SAMPLES), greedy=f.flag("greedy"))
               if f.has("evaluation") and f.flag("evaluation") else {}),
            noise=f.text("noise") if f.has("noise") else "",
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
        return cls(f.integer("accepted"), f.integer("rejected"), f.params("reasons"), f.integer("latest_version"))


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
            created=f.number("created", 0.0), signature=f.signature(),
        )

    @classmethod
    def from_wire(cls, data: bytes, vocab_size: int | None = None) -> RolloutBatch:
        batch = super().from_wire(data)
        if vocab_size is not None:
            batch.check_vocab(vocab_size)
        return batch

    @classmethod
    def signed_body(cls, data: bytes) -> tuple[str, dict[str, Any]]:
        """What the trainer does first with a push: size, then the node's signature over the raw
        body; returns (node id, body) for `from_dict`. A forged or oversized push is refused
        before any sample object exists, and an error after this can be charged to the signer."""
        body = unpack(data, cls.KIND, cls.MAX_BYTES)
        node_key = Fields(body, cls.KIND).blob("node_key", PUBLIC_KEY_BYTES, exact=PUBLIC_KEY_BYTES)
        verify_body(body, node_key, cls.KIND)
        return fingerprint(node_key), body
