import math

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols import wire
from protocols.errors import InvalidValue, MalformedMessage, MessageTooLarge, ProtocolError, UnsupportedVersion
from protocols.messages import (
    MAX_HOLDERS, MAX_SAMPLE_TOKENS, Chunk, ErrorReply, Holders, HoldersRequest, LeaseRequest, ModelFile, NoWork, PushReceipt,
    ReachReply, ReachRequest,
    ChunkRequest, UpdateIndex, UpdateInfo, UpdateRequest, RolloutBatch, RolloutSample, RunManifest, TaskLease,
    WeightUpdate,
)
from tests.unit.protocols import factories

EXAMPLES = [
    factories.manifest(), factories.batch(), factories.update(), factories.holders(), factories.lease(),
    factories.chunk(), factories.model_file(), ErrorReply("bad_lease", "lease L1 expired"), factories.lease_request(),
    factories.lease_request(parallel=32, backend="llama_cpp"),
    NoWork(latest_version=4, retry_after=1.5, finished=False), PushReceipt(3, 1, {"stale": 1}, 5),
    UpdateRequest(6, 7), ChunkRequest((factories.SHA,)),
    UpdateIndex(9, (UpdateInfo(8, 9, 1000, False), UpdateInfo(0, 8, 50_000, True))),
    HoldersRequest(3), Holders(()),
    ReachRequest(40123, relayed=True), ReachReply(False, "/ip4/203.0.113.9/tcp/51234"),
]


def envelope(message, /, **body_changes) -> bytes:
    body = {**message.to_dict(), **body_changes}
    return wire.pack(message.KIND, body)


def without(message, name) -> bytes:
    body = message.to_dict()
    del body[name]
    return wire.pack(message.KIND, body)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.KIND)
def test_round_trip(message):
    assert type(message).from_wire(message.to_wire()) == message


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.KIND)
def test_unknown_fields_are_ignored(message):
    data = envelope(message, from_the_future=[1, 2, {"x": b"y"}])
    assert type(message).from_wire(data) == message


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.KIND)
def test_every_required_field_is_required(message):
    # "relayed": a plain reachability check; "backend", "parallel": lease requests of older nodes
    optional = {"signature", "relayed", "backend", "parallel"}
    for name in message.to_dict():
        if name in optional:
            continue
        with pytest.raises(MalformedMessage, match=name):
            type(message).from_wire(without(message, name))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.KIND)
def test_wrong_types_are_refused(message):
    for name, value in message.to_dict().items():
        wrong = "a string" if not isinstance(value, str) else 12345
        with pytest.raises(ProtocolError):
            type(message).from_wire(envelope(message, **{name: wrong}))


def test_envelope_errors():
    good = factories.lease()
    with pytest.raises(MalformedMessage, match="msgpack"):
        TaskLease.from_wire(b"\xc1not msgpack")
    with pytest.raises(MalformedMessage, match="envelope"):
        TaskLease.from_wire(msgpack.packb([1, 2, 3]))
    with pytest.raises(UnsupportedVersion, match="protocol 99"):
        TaskLease.from_wire(msgpack.packb({"protocol": 99, "kind": "task_lease", "body": good.to_dict()}))
    with pytest.raises(MalformedMessage, match="expected a task_lease"):
        TaskLease.from_wire(factories.chunk().to_wire())
    with pytest.raises(MalformedMessage, match="expected bytes"):
        TaskLease.from_wire("a str")  # type: ignore[arg-type]


def test_oversize_messages_are_refused_before_decoding():
    with pytest.raises(MessageTooLarge, match="exceeds the limit"):
        ErrorReply.from_wire(b"\x00" * (ErrorReply.MAX_BYTES + 1))
    huge = ErrorReply("x", "y" * 20_000)  # to_dict truncates messages, so this one still fits
    assert len(ErrorReply.from_wire(huge.to_wire()).message) == 4096


def test_element_limits():
    with pytest.raises(MessageTooLarge, match="prompt_ids"):
        RolloutBatch.from_wire(factories.batch(samples=(factories.sample(prompt_ids=(1,) * (MAX_SAMPLE_TOKENS + 1)),)).to_wire())
    too_long = factories.sample(prompt_ids=(1,) * MAX_SAMPLE_TOKENS)
    with pytest.raises(MessageTooLarge, match="tokens exceeds"):
        RolloutBatch.from_wire(factories.batch(samples=(too_long,)).to_wire())
    with pytest.raises(MessageTooLarge, match="name"):
        LeaseRequest.from_wire(factories.lease_request(name="n" * 65).to_wire())
    with pytest.raises(MessageTooLarge, match="peers"):
        Holders.from_wire(envelope(factories.holders(), peers=[factories.PEER] * (MAX_HOLDERS + 1)))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logprobs_are_refused(bad):
    sample = factories.sample(logprobs=(-0.5, bad, -1.0, -1.0))
    with pytest.raises(InvalidValue, match="NaN or infinity"):
        RolloutBatch.from_wire(factories.batch(samples=(sample,)).to_wire())


def test_invalid_rollout_values():
    cases = {
        "positive logprob": factories.sample(logprobs=(-0.5, 2.0, -1.0, -1.0)),
        "3 logprobs for 4": factories.sample(logprobs=(-0.5, -1.0, -1.0)),
        "negative token id": factories.sample(prompt_ids=(1, -2)),
        "segments cover": factories.sample(segments=(factories.Segment("model", 3),)),
        "empty prompt": factories.sample(prompt_ids=()),
    }
    for match, sample in cases.items():
        with pytest.raises(InvalidValue, match=match):
            RolloutBatch.from_wire(factories.batch(samples=(sample,)).to_wire())
    with pytest.raises(InvalidValue, match="no samples"):
        RolloutBatch.from_wire(factories.batch(samples=()).to_wire())


def test_token_ids_outside_the_vocab_are_refused():
    data = factories.batch(samples=(factories.sample(completion_ids=(4, 5, 6, 1000)),)).to_wire()
    assert RolloutBatch.from_wire(data).samples[0].completion_ids[-1] == 1000  # structure alone is fine
    with pytest.raises(InvalidValue, match="token id 1000 outside vocab of 1000"):
        RolloutBatch.from_wire(data, vocab_size=1000)
    assert RolloutBatch.from_wire(data, vocab_size=1001).num_tokens == 4


def test_loss_mask_follows_segments():
    assert factories.sample().loss_mask == (1, 1, 0, 1)
    assert factories.sample(segments=()).loss_mask == (1, 1, 1, 1)


def test_manifest_values_are_checked():
    for change, match in [
        ({"mode": "turbo"}, "mode"), ({"staleness": 0}, "staleness"), ({"base_sha256": "ABC"}, "sha256"),
        ({"run_key": b"short"}, "run_key"), ({"temperature": -1.0}, "temperature"),
    ]:
        with pytest.raises(InvalidValue, match=match):
            RunManifest.from_wire(envelope(factories.manifest(), **change))
    with pytest.raises(ProtocolError, match="params"):
        RunManifest.from_wire(envelope(factories.manifest(), update_params={"rank": [1, 2]}))
    with pytest.raises(ProtocolError, match="temperature"):
        RunManifest.from_wire(envelope(factories.manifest(), temperature=True))
    task = factories.manifest().task.to_dict()
    with pytest.raises(InvalidValue, match="max_turns"):
        RunManifest.from_wire(envelope(factories.manifest(), task={**task, "max_turns": 0}))
    with pytest.raises(ProtocolError, match="turns.open"):
        RunManifest.from_wire(envelope(factories.manifest(), turns={"open": "x" * 300, "close": "", "end": ""}))


def test_turn_format_writes_environment_turns_in_the_chat_format():
    turns = factories.manifest().turns
    assert turns.env_text("3 e's", model_stopped=False) == "<|im_end|>\n<|im_start|>user\n3 e's<|im_end|>\n<|im_start|>assistant\n"
    # A model that ended its own turn already wrote <|im_end|>.
    assert turns.env_text("3 e's", model_stopped=True) == "\n<|im_start|>user\n3 e's<|im_end|>\n<|im_start|>assistant\n"


def test_weight_update_values_are_checked():
    with pytest.raises(InvalidValue, match="not after"):
        WeightUpdate.from_wire(factories.update(from_version=2, to_version=2).to_wire())
    tensor = factories.update().tensors[0]
    with pytest.raises(InvalidValue, match="chunks cannot hold"):
        WeightUpdate.from_wire(factories.update(tensors=(factories.TensorEntry(
            tensor.name, tensor.shape, tensor.dtype, tensor.encoding, 8193, tensor.chunks),)).to_wire())
    with pytest.raises(InvalidValue, match="duplicate"):
        WeightUpdate.from_wire(factories.update(tensors=(tensor, tensor)).to_wire())
    with pytest.raises(InvalidValue, match="sha256"):
        Chunk.from_wire(Chunk("zz" * 32, b"x").to_wire())


def test_model_file_values_are_checked():
    with pytest.raises(InvalidValue, match="chunks cannot hold"):
        ModelFile.from_wire(factories.model_file(size=20_000).to_wire())
    with pytest.raises(InvalidValue, match="chunks cannot hold"):
        ModelFile.from_wire(factories.model_file(chunk_size=10_000).to_wire())
    with pytest.raises(InvalidValue):
        ModelFile.from_wire(factories.model_file(size=0, chunks=()).to_wire())
    spans = [factories.model_file().span(i) for i in range(3)]
    assert spans == [(0, 4096), (4096, 4096), (8192, 1808)]  # the last chunk holds the rest


def test_a_lease_requests_batch_is_bounded_and_defaults_to_one():
    request = factories.lease_request(parallel=32)
    assert LeaseRequest.from_wire(without(request, "parallel")).parallel == 1
    for bad in (0, -3, 1025):
        with pytest.raises(InvalidValue, match="parallel"):
            LeaseRequest.from_wire(envelope(request, parallel=bad))


def test_lease_prompts_must_match_seeds():
    with pytest.raises(InvalidValue, match="2 prompts for 3 seeds"):
        TaskLease.from_wire(factories.lease(prompts=((1,), (2,))).to_wire())
    with pytest.raises(InvalidValue, match="empty or negative"):
        TaskLease.from_wire(factories.lease(prompts=((1,), (), (2,))).to_wire())


def test_decode_one_of_dispatches_on_kind():
    lease, idle = factories.lease(), NoWork(1, 2.0)
    assert wire.decode_one_of(lease.to_wire(), (TaskLease, NoWork)) == lease
    assert wire.decode_one_of(idle.to_wire(), (TaskLease, NoWork)) == idle
    with pytest.raises(MalformedMessage, match="expected one of task_lease, no_work"):
        wire.decode_one_of(factories.chunk().to_wire(), (TaskLease, NoWork))


token_ids = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)


@st.composite
def samples(draw):
    completion = draw(token_ids)
    logprobs = draw(st.lists(st.floats(-50.0, 0.0, width=32), min_size=len(completion), max_size=len(completion)))
    return RolloutSample(draw(st.integers(0, 2**63 - 1)), tuple(draw(token_ids)), tuple(completion), tuple(logprobs))


@given(st.lists(samples(), min_size=1, max_size=8), st.integers(0, 2**40),
       st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=40))
def test_rollout_batch_round_trip_property(drawn, version, lease_id):
    batch = factories.batch(samples=tuple(drawn), version=version, lease_id=lease_id)
    assert RolloutBatch.from_wire(batch.to_wire()) == batch


@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_protocol_errors(data):
    for cls in (RunManifest, RolloutBatch, WeightUpdate, TaskLease, Chunk, Holders, ErrorReply, LeaseRequest):
        try:
            cls.from_wire(data)
        except ProtocolError:
            pass


wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@given(st.sampled_from(EXAMPLES), st.data())
def test_mutated_fields_only_ever_raise_protocol_errors(message, data):
    name = data.draw(st.sampled_from(sorted(message.to_dict())))
    value = data.draw(wire_values)
    try:
        type(message).from_wire(envelope(message, **{name: value}))
    except ProtocolError:
        pass


def test_reachability_and_relay_values_are_checked():
    with pytest.raises(InvalidValue, match="port"):
        ReachRequest.from_wire(envelope(ReachRequest(1), port=0))
    with pytest.raises(InvalidValue, match="port"):
        ReachRequest.from_wire(envelope(ReachRequest(1), port=65536))
    # Relayed peers must be listed ones: a reply cannot make a node dial the relay for anyone else.
    with pytest.raises(InvalidValue, match="relayed"):
        Holders.from_wire(envelope(factories.holders(), relayed=[factories.peer_id("Elsewhere")]))


@pytest.mark.parametrize("bad", ["Qm-not-base58", "QmPeer", "1" * 46, factories.peer_id("x")[:-1], "Qm" + "z" * 62,
                                 "12D3KooW" + "A" * 40, ""])
def test_a_peer_id_that_is_no_libp2p_id_is_refused(bad):
    """Peers dial named ids: one that is not base58, or not a sha256 or identity multihash,
    would raise out of hivemind's PeerID in every joining node (issue 36 point 1)."""
    with pytest.raises(InvalidValue, match="peer_id"):
        LeaseRequest.from_wire(envelope(factories.lease_request(), peer_id=bad))
    with pytest.raises(InvalidValue, match="peers"):
        Holders.from_wire(envelope(factories.holders(), peers=[factories.PEER, bad], relayed=[]))


def test_real_peer_ids_pass():
    from protocols.multiaddr import is_peer_id, peer_of

    for real in ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # sha256 of an RSA key (hivemind's)
                 "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA",  # an Ed25519 key itself
                 "16Uiu2HAmLhLvBoYaoZfaMUKuibM6ac163GwKY74c5kiSLg5KvLpY"):  # a secp256k1 key
        assert is_peer_id(real)
        assert peer_of(f"/ip4/1.2.3.4/tcp/5/p2p/{real}") == real
    with pytest.raises(ValueError, match="peer id"):
        peer_of("/ip4/1.2.3.4/tcp/5/p2p/Qm-x")


@pytest.mark.parametrize("text", ["run\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\", "a\x1b]52;c;ZXZpbA==\x07",
                                  "fake\rline", "c1\x9d", "nul\x00"])
def test_text_a_terminal_would_act_on_is_refused_in_every_message(text):
    """OSC links, clipboard writes, carriage returns that overwrite the status line (issue 36 point 9):
    a manifest's run id, task name and base model reach the volunteer's console."""
    for field in ("run_id", "base_model"):
        body = factories.manifest().to_dict()
        with pytest.raises(InvalidValue, match="control characters"):
            RunManifest.from_dict({**body, field: text})
    body = factories.manifest().to_dict()
    with pytest.raises(InvalidValue, match="control characters"):
        RunManifest.from_dict({**body, "task": {**body["task"], "name": text}})
    assert RunManifest.from_dict({**factories.manifest().to_dict(), "run_id": "tab\tand\nnewline ok"})
