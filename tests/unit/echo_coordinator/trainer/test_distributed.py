"""Two trainer processes on gloo take the step one process takes on the same batch, agree on
the weights afterwards, and a rank that disagrees or dies stops the run with a clear error."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch.distributed as dist

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo_coordinator.publish import Publisher
from echo_coordinator.run_dir import RunDir
from echo_coordinator.trainer import distributed, samples as codec, sharded
from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.distributed import DistributedError, Ranks, RanksDisagree
from echo_coordinator.trainer.learner import Trainer
from echo_coordinator.trainer.samples import TrainSample
from protocols import delta
from tests.support.tiny_model import build_tiny_gguf

# Two optimiser steps per batch: the start-of-step logprobs and the minibatch split are shared too.
CONFIG = dict(lora_rank=4, lora_init="random", learning_rate=0.01, threads=1, ppo_minibatches=2, micro_batch_tokens=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")


def batch(seed=0) -> list[TrainSample]:
    """Groups of 4 with rewards that vary, completions of different lengths, one stale sample."""
    rng = np.random.default_rng(seed)
    out = []
    for group in range(5):
        prompt = tuple(int(t) for t in rng.integers(100, 2000, size=int(rng.integers(3, 9))))
        for j in range(4):
            n = int(rng.integers(2, 12))
            out.append(TrainSample(prompt, tuple(int(t) for t in rng.integers(100, 2000, size=n)),
                                   tuple(float(x) for x in -rng.uniform(0.5, 4, size=n)), (1,) * n,
                                   float(rng.integers(0, 2)) if j else 1.0 - (group % 2), group, staleness=j % 2))
    return out


@pytest.fixture
def two_ranks(model, monkeypatch):
    """Rank 0 here, rank 1 in a subprocess (the worker loop): yields a function that starts them."""
    started = []

    def start(worker_config=CONFIG, update="lora", config=CONFIG):
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # ranks whose collectives differ fail, not hang
        dist.set_debug_level_from_env()  # (this process read the variable when it imported torch)
        env = dict(__import__("os").environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
        worker = subprocess.Popen([sys.executable, "-m", "tests.support.trainer_rank", str(model),
                                   json.dumps(worker_config), update], env=env)
        started.append(worker)
        leader = Trainer(model, TrainerConfig(**config), 1.0, update=update, ranks=Ranks(0, 2, 0))
        return leader, worker

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.set_debug_level(dist.DebugLevel.OFF)
    for worker in started:
        worker.kill()
        worker.wait()


def update_of(before: dict, after: dict) -> np.ndarray:
    return np.concatenate([(after[k] - before[k]).ravel() for k in sorted(before)])


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
@pytest.mark.parametrize("update", ["lora", "full"])
def test_two_ranks_take_the_one_process_step(model, two_ranks, update, sharding):
    one = Trainer(model, TrainerConfig(**CONFIG), 1.0, update=update)
    start = one.weights()
    expected = one.step(batch(1))
    config = {**CONFIG, "sharding": sharding}
    leader, worker = two_ranks(update=update, worker_config=config, config=config)
    assert all(np.array_equal(start[k], v) for k, v in leader.weights().items())  # same start
    got = leader.step(batch(1))
    # The same update, to float rounding: summing two ranks' gradients reorders the additions.
    # (Measured 5e-5. Reordering alone, in one process, moves a PPO trajectory by as much: Adam
    # and the ratio clip amplify rounding, so steps after this one are compared rank to rank.)
    ours, theirs = update_of(start, leader.weights()), update_of(start, one.weights())
    assert np.abs(theirs).max() > 1e-3  # the step changed the weights
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-3
    assert (got.samples, got.trained_samples, got.tokens) == (expected.samples, expected.trained_samples, expected.tokens)
    assert got.loss == pytest.approx(expected.loss, rel=1e-4, abs=1e-6)
    assert got.mismatch_kl == pytest.approx(expected.mismatch_kl, rel=1e-4)
    assert got.log_ratio_by_staleness == pytest.approx(expected.log_ratio_by_staleness, rel=1e-4)
    leader.step(batch(2))  # the ranks compare their weights after every step (RanksDisagree if not equal)
    leader.channel.send(distributed.STOP)
    assert worker.wait(timeout=60) == 0


def test_a_rank_that_trains_differently_stops_the_run(two_ranks):
    leader, worker = two_ranks(worker_config={**CONFIG, "learning_rate": 0.02})
    with pytest.raises(RanksDisagree, match="disagree"):
        leader.step(batch(1))
    assert worker.wait(timeout=60) != 0  # the worker stops too


def test_a_dead_rank_is_an_error_not_a_hang(two_ranks):
    leader, worker = two_ranks()
    leader.step(batch(1))
    worker.kill()
    worker.wait()
    with pytest.raises(DistributedError, match="trainer ranks failed"):
        leader.step(batch(2))


def test_shares_cover_the_batch_once_and_balance_tokens():
    lengths = [30, 5, 12, 40, 7, 7, 22, 3, 15]
    indices = list(range(len(lengths)))
    parts = distributed.shares(indices, lengths, 3)
    assert sorted(i for p in parts for i in p) == indices
    tokens = [sum(lengths[i] for i in p) for p in parts]
    assert max(tokens) - min(tokens) <= max(lengths) // 2
    assert distributed.shares(indices, lengths, 1) == [indices]


def test_samples_cross_ranks_unchanged():
    samples = batch(3)
    assert codec.decode(codec.encode(samples)) == [
        dataclasses.replace(s, reward=float(s.reward)) for s in samples]


SHARDED = {**CONFIG, "sharding": "fsdp"}


@pytest.mark.parametrize("update", ["lora", "full"])
def test_sharded_ranks_verify_as_one_process_and_hold_half_the_state(model, two_ranks, update):
    """Rank 0's verification forwards (on a gathered copy, with another version's weights loaded
    into it) give what one process gives, and leave the training step after them as one
    process's; each of 2 sharded ranks holds about half the weights and optimiser state, and rank
    0 publishes the whole weights under the unsharded names."""
    one = Trainer(model, TrainerConfig(**CONFIG), 1.0, update=update)
    leader, worker = two_ranks(update=update, worker_config=SHARDED, config=SHARDED)
    samples, start = batch(4), one.weights()
    held = {k: v + np.float32(0.01) for k, v in start.items()}  # another version's weights
    seeds = list(range(len(samples)))
    for weights in (None, held, held, None):
        expected, got = one.evidence(samples, seeds, weights), leader.evidence(samples, seeds, weights)
        assert [e.tokens for e in got] == [e.tokens for e in expected]
        assert [e.mean_logprob_error for e in got] == pytest.approx([e.mean_logprob_error for e in expected], rel=1e-5)
    for a, b in zip(leader.logprobs(samples[:3]), one.logprobs(samples[:3])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    ours = leader.weights()
    assert ours.keys() == start.keys() and all(np.array_equal(ours[k], start[k]) for k in ours)  # as they were

    one.step(samples)
    leader.step(samples)  # FSDP forgot rank 0's own forwards: the ranks gather and reduce alike
    ours, theirs = update_of(start, leader.weights()), update_of(start, one.weights())
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-3

    whole, shard = sharded.held_bytes(one.model, one.optimizer), sharded.held_bytes(leader.model, leader.optimizer)
    # Rank 0's shard of each weight is its first half, rounded up: within a few rows of half.
    assert shard["parameters"] == pytest.approx(whole["parameters"] / 2, rel=0.03), (shard, whole)
    assert shard["optimizer"] == pytest.approx(whole["optimizer"] / 2, rel=0.03), (shard, whole)
    print(f"{update}: one process {whole}, sharded rank 0 {shard}")
    leader.channel.send(distributed.STOP)
    assert worker.wait(timeout=60) == 0


def density_ending_in_a_tie(residual: np.ndarray, at_least: float) -> float:
    """A topk density past `at_least` whose k-th largest |residual| equals the (k+1)-th."""
    magnitudes = np.sort(np.abs(residual.ravel()))[::-1]
    tied = np.flatnonzero(magnitudes[:-1] == magnitudes[1:]) + 1  # k with magnitudes[k - 1] == magnitudes[k]
    k = int(tied[tied >= at_least * magnitudes.size][0])
    density = (k - 0.5) / magnitudes.size
    assert delta.topk_count(magnitudes.size, density) == k
    return density


def test_sharded_full_mode_publishes_what_one_process_would_without_gathering(model, two_ranks, monkeypatch):
    """Each update, encoded where the shards live, is byte for byte the payload the unsharded
    publisher makes from the gathered weights, and the ranks' shards of the view keep up with it
    over several updates; no weight is gathered onto rank 0 to encode it."""
    leader, worker = two_ranks(update="full", worker_config=SHARDED, config=SHARDED)
    start = leader.weights()
    reference = delta.DeltaEncoder(start)
    publisher = Publisher("run", Ed25519PrivateKey.generate(), "full", start, "topk-int8", 0.01, 100)
    leader.hold_view(publisher.view())
    gathers = []
    # The third update's density puts the embeddings' k-th largest |residual| inside a run of equal
    # values (equal values, or x and -x: a fifth of them repeat): the sharded ranks take tied entries
    # lowest index first, where the unsharded encoder's argpartition takes its own pick (an equally
    # good payload). (A fixed density of 0.6 found a tie on one machine and none on another.)
    tied = []
    for seed, density in ((1, 0.01), (2, 0.01), (3, None)):
        leader.step(batch(seed))
        target = leader.weights()
        if density is None:
            embed = "model.embed_tokens.weight"
            density = density_ending_in_a_tie(reference.residual(embed, target[embed]), 0.6)
        publisher.density = density
        with monkeypatch.context() as m:
            m.setattr(sharded, "full", lambda *a, **k: gathers.append(a))
            [(update, chunks)] = publisher.publish(seed, None, leader.topk_delta(density))
        got = {t.name: b"".join(chunks[d] for d in t.chunks) for t in update.tensors}
        expected = {}
        for name in start:
            residual = reference.residual(name, target[name]).ravel()
            k = delta.topk_count(residual.size, density)
            chosen = np.sort(np.lexsort((np.arange(residual.size), -np.abs(residual)))[:k])  # ties: lowest first
            expected[name] = delta.topk_payload(chosen, residual[chosen])
            if density < 0.5:  # no ties: what the unsharded publisher sends
                assert expected[name] == delta.encode(residual, "topk-int8", density=density)
            elif k < residual.size and np.equal(*np.sort(np.abs(residual))[::-1][k - 1 : k + 1]):
                tied.append(name)  # the k-th and (k+1)-th largest |residual| are equal
        assert got == expected
        reference.advance(expected, "topk-int8")
        assert all(np.array_equal(publisher.view()[k], reference.view(k)) for k in start)
    assert tied  # the ties were there
    assert gathers == []
    leader.channel.send(distributed.STOP)
    assert worker.wait(timeout=60) == 0


def test_sharded_ranks_resume_after_a_kill_with_the_same_next_step(model, two_ranks, tmp_path):
    leader, worker = two_ranks(update="full", worker_config=SHARDED, config=SHARDED)
    leader.step(batch(1))
    saved = leader.weights()
    leader.save(tmp_path / "ckpt", None)  # full mode: every rank writes its shards, rank 0 gathers nothing
    assert any((tmp_path / "ckpt" / "optimizer").glob("*.distcp"))  # each rank's shard of the optimiser
    assert not (tmp_path / "ckpt" / "weights.safetensors").exists()
    whole = RunDir.weights_of(tmp_path / "ckpt")  # what export and eval read, in one process
    assert whole.keys() == saved.keys() and all(np.array_equal(whole[k], saved[k]) for k in saved)
    leader.step(batch(2))
    expected = leader.weights()
    worker.kill()  # SIGKILL
    worker.wait()
    dist.destroy_process_group()

    leader, worker = two_ranks(update="full", worker_config=SHARDED, config=SHARDED)
    leader.load(tmp_path / "ckpt")
    leader.step(batch(2))
    got = leader.weights()
    assert max(float(np.abs(got[k] - expected[k]).max()) for k in got) < 1e-6
    leader.channel.send(distributed.STOP)
    assert worker.wait(timeout=60) == 0


def test_a_sharded_rank_that_dies_or_trains_differently_stops_the_run(two_ranks):
    leader, worker = two_ranks(worker_config={**SHARDED, "learning_rate": 0.02}, config=SHARDED)
    with pytest.raises(RanksDisagree, match="disagree"):
        leader.step(batch(1))
    assert worker.wait(timeout=60) != 0
    dist.destroy_process_group()

    leader, worker = two_ranks(worker_config=SHARDED, config=SHARDED)
    leader.step(batch(1))
    worker.kill()
    worker.wait()
    with pytest.raises(DistributedError, match="trainer ranks failed"):
        leader.step(batch(2))


def test_a_sharded_run_needs_ranks_and_one_process_tools_load_it_whole(model, tmp_path):
    from echo_coordinator.config import RunConfig
    from echo_coordinator.startup import Coordinator
    from protocols.errors import ConfigError

    run = RunConfig(model=str(model), data_dir=str(tmp_path / "run"), dashboard=False)
    with pytest.raises(ConfigError, match=r"set \[trainer\] procs"):
        Coordinator(run, TrainerConfig(sharding="fsdp"), model)
    alone = Trainer(model, TrainerConfig(**SHARDED), 1.0)  # export and eval read the run's config
    assert not alone.sharded and alone.weights().keys() == Trainer(model, TrainerConfig(**CONFIG), 1.0).weights().keys()


def test_checkpointing_activations_changes_no_update(model):
    plain = Trainer(model, TrainerConfig(**CONFIG), 1.0, update="full")
    recomputed = Trainer(model, TrainerConfig(**CONFIG, activation_checkpointing=True), 1.0, update="full")
    start = plain.weights()
    plain.step(batch(1))
    recomputed.step(batch(1))
    a, b = update_of(start, plain.weights()), update_of(start, recomputed.weights())
    assert np.abs(a).max() > 1e-3
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-5
