"""What a run is and who takes part: the manifest, who holds a version, who can be dialled, error replies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocols.errors import InvalidValue
from protocols.signing import PUBLIC_KEY_BYTES
from protocols.wire import Fields, WireMessage

MODES = ("sequential", "async")
UPDATE_MODES = ("lora", "full")
MAX_ADDRS = 16
HARDWARE_CHARS = 128  # a peer's hardware line (its backend, devices and KV cache)
MAX_HOLDERS = 32  # peers one `Holders` reply lists: enough to spread a fetch, few enough to be cheap
MAX_SAMPLE_TOKENS = 32768  # prompt + completion, per sample (also bounds max_new_tokens)
MAX_TURNS = 100  # model turns per multi-turn episode


@dataclass(frozen=True)
class TaskSpec:
    """Which environment a run trains on, and its generator parameters (difficulty, ...)."""

    name: str  # a built-in task, an entry point name, or "module:Class" (see tasks.registry)
    params: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 1  # model turns per episode; above 1, nodes step the environment themselves

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params), "max_turns": self.max_turns}

    @classmethod
    def from_dict(cls, body: Any) -> TaskSpec:
        f = Fields(body, "task")
        return cls(name=f.text("name", 256), params=f.params("params"), max_turns=f.integer("max_turns", 1, MAX_TURNS))


@dataclass(frozen=True)
class TurnFormat:
    """How an environment's reply enters a multi-turn transcript, in the base model's chat format.

    After a model turn the transcript continues with `open` + observation + `close`, and `close`
    ends by opening the model's next turn. For ChatML: open = "<|im_end|>\\n<|im_start|>user\\n",
    close = "<|im_end|>\\n<|im_start|>assistant\\n", end = "<|im_end|>". `end` is the text of the
    model's end-of-turn token: a turn the model ended itself already holds it, so `open` is then
    written without it. The trainer derives all three from its tokenizer's chat template."""

    open: str = ""
    close: str = ""
    end: str = ""

    def env_text(self, observation: str, model_stopped: bool) -> str:
        opening = self.open
        if model_stopped and self.end and opening.startswith(self.end):
            opening = opening[len(self.end):]
        return opening + observation + self.close

    def to_dict(self) -> dict[str, Any]:
        return {"open": self.open, "close": self.close, "end": self.end}

    @classmethod
    def from_dict(cls, body: Any) -> TurnFormat:
        f = Fields(body, "turns")
        return cls(open=f.text("open", 256), close=f.text("close", 256), end=f.text("end", 64))


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
    turns: TurnFormat = TurnFormat()  # multi-turn tasks: how environment replies are written
    created: float = 0.0
    signature: bytes = b""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "base_model": self.base_model, "base_sha256": self.base_sha256,
            "vocab_size": self.vocab_size, "mode": self.mode, "update": self.update,
            "staleness": self.staleness, "task": self.task.to_dict(), "group_size": self.group_size,
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
            "run_key": self.run_key, "trainer_addrs": list(self.trainer_addrs),
            "update_params": dict(self.update_params), "turns": self.turns.to_dict(), "created": self.created,
            "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> RunManifest:
        f = Fields(body, cls.KIND)
        return cls(
            run_id=f.text("run_id"), base_model=f.text("base_model"), base_sha256=f.sha256("base_sha256"),
            vocab_size=f.integer("vocab_size", 1, 2**24), mode=f.text("mode", choices=MODES),
            update=f.text("update", choices=UPDATE_MODES), staleness=f.integer("staleness", 1, 1000),
            task=TaskSpec.from_dict(f.mapping("task", 3)), group_size=f.integer("group_size", 1, 256),
            max_new_tokens=f.integer("max_new_tokens", 1, MAX_SAMPLE_TOKENS),
            temperature=f.number("temperature", 1e-3, 100.0),
            run_key=f.blob("run_key", PUBLIC_KEY_BYTES, exact=PUBLIC_KEY_BYTES),
            trainer_addrs=tuple(f.texts("trainer_addrs", MAX_ADDRS, 512)),
            update_params=f.params("update_params"), turns=TurnFormat.from_dict(f.mapping("turns", 3)),
            created=f.number("created", 0.0),
            signature=f.signature(),
        )


@dataclass(frozen=True)
class HoldersRequest(WireMessage):
    """Which peers hold `version` or a later one (0: the base model)? Asked of the coordinator,
    which knows from the nodes' own lease requests, over streams the transport authenticated."""

    KIND = "holders_request"
    MAX_BYTES = 256

    version: int

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> HoldersRequest:
        return cls(version=Fields(body, cls.KIND).integer("version"))


@dataclass(frozen=True)
class Holders(WireMessage):
    """Some peers that hold the asked version (at most MAX_HOLDERS, drawn by the coordinator),
    and which of them are reached only through the coordinator's relay (behind NAT)."""

    KIND = "holders"
    MAX_BYTES = 8 * 1024

    peers: tuple[str, ...]  # libp2p peer ids
    relayed: tuple[str, ...] = ()  # those of `peers` dialled through the coordinator's relay circuit

    def to_dict(self) -> dict[str, Any]:
        return {"peers": list(self.peers), "relayed": list(self.relayed)}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Holders:
        f = Fields(body, cls.KIND)
        peers = tuple(f.peer_ids("peers", MAX_HOLDERS))
        relayed = tuple(f.peer_ids("relayed", MAX_HOLDERS))
        if not set(relayed) <= set(peers):
            raise InvalidValue(f"{cls.KIND}.relayed: names peers it does not list")
        return cls(peers=peers, relayed=relayed)


@dataclass(frozen=True)
class ReachRequest(WireMessage):
    """Can you dial me? The asker's libp2p port; the answering peer dials it at the address the
    asker's stream came from (never at an address the asker names), or through its own relay."""

    KIND = "reach_request"
    MAX_BYTES = 256

    port: int  # the TCP port the asker's libp2p host listens on
    relayed: bool = False  # dial through the answering peer's relay instead of directly

    def to_dict(self) -> dict[str, Any]:
        return {"port": self.port, "relayed": self.relayed}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ReachRequest:
        f = Fields(body, cls.KIND)
        return cls(port=f.integer("port", 1, 65535), relayed=f.flag("relayed") if f.has("relayed") else False)


@dataclass(frozen=True)
class ReachReply(WireMessage):
    """Whether a fresh peer could dial the asker, and the address the asker was seen at."""

    KIND = "reach_reply"
    MAX_BYTES = 1024

    reachable: bool
    observed: str  # the multiaddr the asker's stream came from

    def to_dict(self) -> dict[str, Any]:
        return {"reachable": self.reachable, "observed": self.observed}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ReachReply:
        f = Fields(body, cls.KIND)
        return cls(reachable=f.flag("reachable"), observed=f.text("observed", 256))


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
