"""llama.cpp generation (batched) and LoRA hot-swap against the HF/peft trainer on a tiny real model."""

import threading

import numpy as np
import pytest

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.learner import Trainer
from echo_coordinator.trainer.samples import TrainSample
from engines.backend import Interrupted, Request, generate_one
from engines.gguf_io import write_lora_adapter
from engines.hf import prompt_ids
from engines.llama_backend import LlamaBackend
from engines.llama_batch import DecodeError
from tasks import make_task
from tests.support.tiny_model import build_tiny_gguf


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")
    trainer = Trainer(path, TrainerConfig(lora_rank=4, lora_init="random", threads=1), temperature=0.7)
    backend = LlamaBackend(path, threads=1, n_ctx=256)
    prompt = list(prompt_ids(trainer.tokenizer, make_task("arithmetic").generate(5).messages))
    return trainer, backend, prompt, tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def one_at_a_time(setup, tmp_path_factory):
    return LlamaBackend(setup[1].model_path, threads=1, n_ctx=256, parallel=1)


def same(a, b) -> bool:
    # Batches of other shapes round differently: logits agree to ~1e-6 on this fp32 model, not bit for bit.
    return a.token_ids == b.token_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-4)


def trainer_logprobs(trainer, prompt, completion):
    sample = TrainSample(tuple(prompt), completion.token_ids, completion.logprobs, (1,) * len(completion.token_ids), 0.0, 0)
    return trainer.logprobs([sample])[0]


def test_behaviour_logprobs_match_the_trainer_with_and_without_adapter(setup):
    trainer, backend, prompt, adapters = setup
    backend.set_adapter(None)
    with trainer.model.disable_adapter():
        base = generate_one(backend, prompt, 12, 0.7, 3)
        assert np.abs(trainer_logprobs(trainer, prompt, base) - np.array(base.logprobs)).max() < 1e-4

    path = adapters / "v1.gguf"
    write_lora_adapter(trainer.weights(), trainer.config.lora_alpha, path, backend.layout)
    backend.set_adapter(path)
    adapted = generate_one(backend, prompt, 12, 0.7, 3)
    assert np.abs(trainer_logprobs(trainer, prompt, adapted) - np.array(adapted.logprobs)).max() < 1e-4
    assert adapted.token_ids != base.token_ids or adapted.logprobs != base.logprobs  # the adapter is live


def test_same_seed_same_sample(setup):
    _, backend, prompt, _ = setup
    first = generate_one(backend, prompt, 10, 1.0, 11)
    other = generate_one(backend, prompt, 10, 1.0, 12)
    again = generate_one(backend, prompt, 10, 1.0, 11)
    assert same(first, again) and not same(first, other)
    assert all(lp <= 0 for lp in first.logprobs) and backend.throughput > 0


def lease_requests(trainer, seeds=(5, 6, 7), group=4):
    """A lease's requests: G samples of each prompt, prompts of different lengths, one greedy."""
    requests = []
    for seed in seeds:
        prompt = tuple(prompt_ids(trainer.tokenizer, make_task("arithmetic").generate(seed).messages))
        requests += [Request(prompt + (seed,) * (seed - 5), 6 + 3 * j, 100 * seed + j) for j in range(group)]
    return requests + [Request(requests[0].prompt_ids, 9, None)]


def test_a_batch_samples_what_each_sequence_samples_alone(setup, one_at_a_time):
    """Batched decoding (shared prompts, sequences of other lengths ending at other steps, more
    requests than slots) gives each sequence what it gives alone: a sequence that saw another's
    KV cells, or sampled another's logits row or noise, would differ."""
    trainer, backend, _, _ = setup
    backend.set_adapter(None)
    requests = lease_requests(trainer)
    assert len(requests) > backend.parallel
    batched = backend.generate(requests, 1.0)
    alone = [one_at_a_time.generate([r], 1.0)[0] for r in requests]
    assert all(same(b, a) for b, a in zip(batched, alone))
    assert [len(c.token_ids) for c in batched] != [len(batched[0].token_ids)] * len(batched)
    assert len({c.token_ids for c in batched[:4]}) == 4  # one prompt, four noise seeds: four samples
    reordered = backend.generate(list(reversed(requests)), 1.0)[::-1]  # other company at every step
    assert all(same(a, b) for a, b in zip(batched, reordered))


def test_a_late_sibling_shares_the_prompt_a_live_sequence_holds(setup, one_at_a_time):
    """A group's samples admitted later, into slots freed by shorter ones, take the prompt's cells
    from a sibling still decoding and evaluate only its last token; they sample what they sample alone."""
    trainer, _, prompt, _ = setup
    backend = LlamaBackend(one_at_a_time.model_path, threads=1, n_ctx=256, parallel=4)
    requests = [Request(tuple(prompt), 3 + 2 * j, 50 + j) for j in range(8)]  # slots free one at a time
    batched = backend.generate(requests, 1.0)
    alone = [one_at_a_time.generate([r], 1.0)[0] for r in requests]
    assert all(same(b, a) for b, a in zip(batched, alone))
    once = len(prompt) + sum(len(c.token_ids) - 1 for c in batched)  # each sampled token but the last is evaluated
    assert backend.batch.evaluated == once + 4  # the four late samples: one prompt token each, not the prompt


def test_a_batch_with_an_adapter_agrees_with_the_trainer(setup):
    trainer, backend, _, adapters = setup
    path = adapters / "batch.gguf"
    write_lora_adapter(trainer.weights(), trainer.config.lora_alpha, path, backend.layout)
    backend.set_adapter(path)
    requests = lease_requests(trainer, seeds=(8, 9))
    for request, out in zip(requests, backend.generate(requests, 0.7)):
        errors = trainer_logprobs(trainer, request.prompt_ids, out) - np.array(out.logprobs)
        assert np.abs(errors).max() < 1e-4
    backend.set_adapter(None)


def test_follow_continues_a_sequence_and_evaluates_only_the_new_tokens(setup, one_at_a_time):
    """Multi-turn: a turn's continuation extends the prompt; batched and alone agree."""
    trainer, backend, _, _ = setup
    requests = lease_requests(trainer, seeds=(5, 6), group=3)[:-1]
    reply = (40, 41, 42)

    def follow_for(log):
        def follow(index, done):
            log.append((index, done))
            turns = sum(1 for i, _ in log if i == index)
            if turns == 2:
                return None
            r = requests[index]
            return Request(r.prompt_ids + done.token_ids + reply, 5, r.seed, offset=len(done.token_ids) + len(reply))
        return follow

    batched_log, alone_log = [], []
    last = backend.generate(requests, 1.0, follow_for(batched_log))
    for index, r in enumerate(requests):
        one_at_a_time.generate([r], 1.0, lambda i, done: follow_for(alone_log)(index, done))
    assert len(batched_log) == 2 * len(requests)
    by_index = {i: [d for j, d in batched_log if j == i] for i in range(len(requests))}
    alone = {i: [d for j, d in alone_log if j == i] for i in range(len(requests))}
    assert all(same(a, b) for i in by_index for a, b in zip(by_index[i], alone[i]))
    assert all(same(last[i], by_index[i][-1]) for i in by_index)


def test_generation_stops_when_interrupted(setup):
    trainer, _, prompt, _ = setup
    stop = threading.Event()
    backend = LlamaBackend(setup[1].model_path, threads=1, n_ctx=256, interrupt=stop)
    stop.set()
    with pytest.raises(Interrupted):
        generate_one(backend, prompt, 10, 1.0, 1)
    with pytest.raises(ValueError, match="no room"):
        generate_one(backend, list(range(256)), 4, 1.0, 1)


def test_a_bad_adapter_file_leaves_the_old_adapter_active(setup, tmp_path):
    trainer, backend, prompt, adapters = setup
    path = adapters / "good.gguf"
    write_lora_adapter(trainer.weights(), trainer.config.lora_alpha, path, backend.layout)
    backend.set_adapter(path)
    before = generate_one(backend, prompt, 6, 1.0, 1)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match="could not load"):
        backend.set_adapter(junk)
    assert same(generate_one(backend, prompt, 6, 1.0, 1), before)
    backend.set_adapter(None)


def test_on_a_gpu_backend_each_adapter_goes_into_a_fresh_context_that_samples_the_same(setup, monkeypatch):
    """GPU backends take each adapter in a new context (an in-place swap crashed Vulkan's next
    decode). Forced here on the CPU: the fresh context samples exactly what the swapped one does,
    the old one is closed, and the adapter is live in the new one."""
    trainer, backend, prompt, adapters = setup
    path = adapters / "fresh.gguf"
    write_lora_adapter(trainer.weights(), trainer.config.lora_alpha, path, backend.layout)
    backend.set_adapter(path)
    in_place = generate_one(backend, prompt, 12, 0.7, 3)
    backend.set_adapter(None)
    base = generate_one(backend, prompt, 12, 0.7, 3)
    monkeypatch.setattr(backend, "offloaded", True)
    old = backend.batch
    backend.set_adapter(path)
    assert backend.batch is not old and old.ctx is None
    assert same(generate_one(backend, prompt, 12, 0.7, 3), in_place)
    backend.set_adapter(None)
    assert same(generate_one(backend, prompt, 12, 0.7, 3), base)
    with pytest.raises(DecodeError, match="closed"):
        old.decode([(prompt[0], 0, [0], True)])


def test_full_mode_reexport_requantizes_to_the_joined_type_and_reloads(setup, tmp_path):
    import ctypes

    import llama_cpp

    from engines.full_weights import export_quantized
    from engines.hf import load_master

    trainer, _, prompt, _ = setup
    f32 = build_tiny_gguf(tmp_path / "f32.gguf")
    joined = tmp_path / "q8.gguf"  # a volunteer who joined with a q8_0 copy of the base
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(joined).encode(), ctypes.byref(params)) == 0
    backend = LlamaBackend(joined, threads=1, n_ctx=256)
    assert backend.file_type == llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    config, master = load_master(f32)
    master = {k: v * 1.5 if k.endswith("mlp.down_proj.weight") else v for k, v in master.items()}
    out = export_quantized(config, master, joined, tmp_path / "v1.gguf", backend.file_type)
    before = generate_one(backend, prompt, 6, 1.0, 4)
    backend.reload(out)
    reloaded = LlamaBackend(out, threads=1, n_ctx=256)
    assert reloaded.file_type == llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0 and out.stat().st_size < f32.stat().st_size / 2
    after = generate_one(backend, prompt, 6, 1.0, 4)
    assert after.logprobs != before.logprobs  # the new weights are live
    assert not (tmp_path / "v1.f32.gguf").exists()  # the fp32 intermediate is cleaned up


def test_token_text_matches_the_trainers_tokenizer(setup):
    """The node's action text must be the trainer's, or multi-turn replays would diverge. Token
    40672 is 65 '=' characters, which llama-cpp-python's own detokenize drops."""
    trainer, backend, _, _ = setup
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = [int(i) for i in rng.integers(0, backend.vocab_size, rng.integers(1, 20))] + [40672, 2, 1]
        rng.shuffle(ids)
        expected = trainer.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert backend.detokenize(ids) == expected
    text = "\n<|im_start|>user\nMoves: up, left ✓<|im_end|>\n<|im_start|>assistant\n"
    assert backend.tokenize(text) == trainer.tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("tamper, reason", [
    (lambda a: a[:, None, :], "not matrices"),  # 3-D: llama.cpp took it and aborted at the first decode
    (lambda a: a.T.copy(), "do not fit"),  # (in, r): r and in swapped
    (lambda a: a[:, :-1], "do not fit"),  # one input column short
    (lambda a: a[:0], "do not fit"),  # rank 0
])
def test_an_adapter_that_does_not_fit_the_base_never_reaches_llama_cpp(setup, tamper, reason):
    """A coordinator's LoRA factors are checked against the base's tensor shapes before a GGUF
    adapter is written: llama.cpp asserts (and kills the node) on shapes it cannot multiply."""
    trainer, backend, prompt, adapters = setup
    weights = trainer.weights()
    name = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    bad = {**weights, name: tamper(weights[name])}
    with pytest.raises(ValueError, match=reason):
        write_lora_adapter(bad, trainer.config.lora_alpha, adapters / "bad.gguf", backend.layout)
    renamed = {k.replace("layers.0.", "layers.99."): v for k, v in weights.items()}
    with pytest.raises(ValueError, match="no GGUF name"):
        write_lora_adapter(renamed, trainer.config.lora_alpha, adapters / "bad.gguf", backend.layout)
    backend.set_adapter(None)
    assert generate_one(backend, prompt, 4, 0.7, 3).token_ids  # still serving


def test_a_steps_rows_are_read_in_place_and_a_shared_row_is_copied(setup):
    """`BatchContext.rows` of one row a sequence is llama.cpp's buffer itself (no R x V copy a step);
    rows that repeat an entry (a prompt serving its group) are copied; both hold each entry's logits."""
    _, backend, prompt, _ = setup
    context = backend.batch
    context.clear()
    context.decode([(t, k, [0, 1], k == len(prompt) - 1) for k, t in enumerate(prompt)])
    last = len(prompt) - 1
    shared = context.rows([last, last])
    assert shared.shape == (2, context.vocab) and (shared == context.logits(last)).all()
    assert not np.shares_memory(shared, context.logits(last))
    context.decode([(7, len(prompt), [0], True), (9, len(prompt), [1], True)])
    step = context.rows([0, 1])
    assert np.shares_memory(step, context.logits(0))
    assert (step[0] == context.logits(0)).all() and (step[1] == context.logits(1)).all()
    assert not (step[0] == step[1]).all()  # two tokens, two rows
    context.clear()
