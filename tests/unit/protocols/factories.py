"""Valid example messages for tests to mutate."""

from protocols.messages import (
    Chunk, Holders, LeaseRequest, ModelFile, RolloutBatch, RolloutSample, RunManifest, Segment, TaskLease, TaskSpec,
    TensorEntry, TurnFormat, WeightUpdate,
)
from protocols.multiaddr import _BASE58
from protocols.signing import sha256_hex

KEY = bytes(range(32))
SHA = sha256_hex(b"base model")


def peer_id(name: str) -> str:
    """A well-formed libp2p peer id standing for `name`: the base58 sha256 multihash of it."""
    number = int.from_bytes(bytes([0x12, 0x20]) + bytes.fromhex(sha256_hex(name.encode())), "big")
    digits = ""
    while number:
        number, digit = divmod(number, 58)
        digits = _BASE58[digit] + digits
    return digits


PEER = peer_id("alice")


def manifest(**kw) -> RunManifest:
    fields = dict(
        run_id="run-1", base_model="tiny.gguf", base_sha256=SHA, vocab_size=1000, mode="sequential",
        update="lora", staleness=4, task=TaskSpec("arithmetic", {"digits": 1, "ops": "+"}), group_size=4,
        max_new_tokens=32, temperature=1.0, run_key=KEY, trainer_addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id('trainer')}",),
        update_params={"rank": 8, "alpha": 16.0}, created=1.5,
        turns=TurnFormat("<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>"),
    )
    return RunManifest(**{**fields, **kw})


def sample(**kw) -> RolloutSample:
    fields = dict(
        seed=7, prompt_ids=(1, 2, 3), completion_ids=(4, 5, 6, 7), logprobs=(-0.5, -1.25, 0.0, -3.0),
        segments=(Segment("model", 2), Segment("env", 1), Segment("model", 1)),
    )
    return RolloutSample(**{**fields, **kw})


def batch(**kw) -> RolloutBatch:
    fields = dict(run_id="run-1", lease_id="L1", version=3, node_key=KEY, samples=(sample(), sample(seed=8)), created=2.0)
    return RolloutBatch(**{**fields, **kw})


def update(**kw) -> WeightUpdate:
    tensor = TensorEntry("blk.0.attn_q.lora_a", (8, 64), "float32", "dense-fp32", 2048, (SHA,))
    fields = dict(run_id="run-1", from_version=0, to_version=1, mode="lora", tensors=(tensor,), chunk_size=4096,
                  params={"alpha": 16.0}, created=3.0)
    return WeightUpdate(**{**fields, **kw})


def holders(**kw) -> Holders:
    fields = dict(peers=(PEER, peer_id("Other")), relayed=(peer_id("Other"),))
    return Holders(**{**fields, **kw})


def model_file(**kw) -> ModelFile:
    fields = dict(run_id="run-1", name="tiny-q8_0.gguf", sha256=SHA, size=10_000, chunk_size=4096,
                  chunks=(SHA, sha256_hex(b"2"), sha256_hex(b"3")))
    return ModelFile(**{**fields, **kw})


def lease(**kw) -> TaskLease:
    fields = dict(lease_id="L1", run_id="run-1", node_id="abc", seeds=(1, 2, 2**40), prompts=((1, 2), (3,), (4, 5, 6)),
                  version=3, expires_at=9.0)
    return TaskLease(**{**fields, **kw})


def lease_request(**kw) -> LeaseRequest:
    fields = dict(run_id="run-1", node_key=KEY, peer_id=PEER, name="alice", version=2, max_seeds=4, time=5.0)
    return LeaseRequest(**{**fields, **kw})


def chunk() -> Chunk:
    return Chunk(sha256_hex(b"payload"), b"payload")
