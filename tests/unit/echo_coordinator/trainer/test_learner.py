"""Verification's forward: a group's prompt runs once and its KV cache serves every completion,
several groups (prompts of other lengths, left-padded) in one forward; the logits must be the
ones the packed forward of whole sequences gives."""

import torch

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.evidence import completion_hidden, completion_logits, scaled
from echo_coordinator.trainer.learner import Trainer
from echo_coordinator.trainer.samples import TrainSample
from echo_coordinator.trainer.tensors import prompt_groups
from engines.sampler import sample_rows
from tests.unit.echo_coordinator.trainer.test_grpo import samples_for, tiny  # noqa: F401 (fixture)


def test_shared_prompt_logits_are_the_packed_forwards(tiny):  # noqa: F811
    trainer = Trainer(tiny, TrainerConfig(lora_rank=4, lora_init="random", threads=1), temperature=0.7)
    samples = samples_for(trainer)
    groups = prompt_groups(samples, trainer.config.micro_batch_tokens)
    assert sorted(map(sorted, groups)) == [[0, 1], [2, 3]]
    with torch.no_grad():
        each = []
        for indices in groups:
            part = [samples[i] for i in indices]
            shared = completion_logits(trainer, part)
            ids, mask, _ = trainer._pack(part)
            packed = trainer._scaled_logits(ids, mask > 0)
            assert shared.shape == packed.shape == (sum(sum(s.loss_mask) for s in part), trainer.model.config.vocab_size)
            assert (shared - packed).abs().max() < 1e-4  # env tokens (mask 0) are left out of both
            each.append(packed)
        hidden, head = completion_hidden(trainer, [[samples[i] for i in indices] for indices in groups])
        together = scaled(trainer, head(hidden))
        assert len({len(samples[g[0]].prompt_ids) for g in groups}) == 2  # one prompt is left-padded
        assert (together - torch.cat(each)).abs().max() < 1e-4


def test_evidence_of_the_trainers_own_samples_is_clean(tiny):  # noqa: F811
    """Tokens the trainer itself samples under the lease noise have margin 0 and their own logprobs."""
    trainer = Trainer(tiny, TrainerConfig(lora_rank=4, lora_init="random", threads=1), temperature=1.0)
    prompt = samples_for(trainer)[0].prompt_ids
    ids, seeds = list(prompt), 77
    with torch.no_grad():
        for position in range(6):  # the trainer samples with the noise of sample seed 77, a token at a time
            last = torch.zeros(1, len(ids), dtype=torch.bool)
            last[0, -1] = True
            row = trainer._scaled_logits(torch.tensor([ids + [0]]), last)  # (1, V)
            ids.append(int(sample_rows(row.numpy(), 1.0, [seeds], [position])[0][0]))
    completion = tuple(ids[len(prompt):])
    lp = trainer.logprobs([TrainSample(prompt, completion, (0.0,) * 6, (1,) * 6, 0.0, 0)])[0]
    sample = TrainSample(prompt, completion, tuple(float(x) for x in lp), (1,) * 6, 0.0, 0)
    found = trainer.evidence([sample], [seeds])[0]
    assert found.flips == 0 and found.max_margin == 0 and found.max_logprob_error < 1e-4
    shifted = trainer.evidence([sample], [seeds + 1])[0]  # another sample's noise: these tokens were not its
    assert shifted.flips > 0


def test_bf16_compute_steps_fp32_weights_as_an_fp32_step_would(tiny):  # noqa: F811
    """Full mode under bf16 compute (a GPU's) keeps fp32 master weights: at lr 1e-6 against weights
    of ~0.3, an update is ~1/300000 of its weight, which bf16 weights (8 bits of mantissa) round to
    nothing; the master weights move as the fp32 step's do."""
    def moved(precision: str) -> torch.Tensor:
        trainer = Trainer(tiny, TrainerConfig(learning_rate=1e-6, threads=1, precision=precision), 1.0, update="full")
        before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
        trainer.step(samples_for(trainer))
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()]) - before

    fp32, bf16 = moved("fp32"), moved("bf16")
    assert (fp32 != 0).float().mean() > 0.2  # (embeddings of tokens the batch lacks get no gradient)
    assert (bf16 != 0).float().mean() > 0.9 * (fp32 != 0).float().mean()  # bf16 weights: almost none would move
    cosine = torch.nn.functional.cosine_similarity(fp32, bf16, dim=0)
    assert cosine > 0.95 and abs(bf16.norm() / fp32.norm() - 1) < 0.1, (float(cosine), float(bf16.norm() / fp32.norm()))


def test_holding_swaps_a_version_in_and_gives_the_trainers_own_back(tiny):  # noqa: F811
    """`holding` runs with another version's weights and leaves the trainer's own bit for bit, without
    copying them: the parameters get their own storage back."""
    trainer = Trainer(tiny, TrainerConfig(threads=1), 1.0, update="full")
    own = {n: p.data_ptr() for n, p in trainer.model.named_parameters()}
    other = {k: v * 0.5 for k, v in trainer.weights().items()}
    samples = samples_for(trainer)
    mine = trainer.logprobs(samples[:1])[0]
    for _ in range(2):  # the second time from the version kept on the device
        with trainer.holding(other):
            theirs = trainer.logprobs(samples[:1])[0]
    assert all(p.data_ptr() == own[n] for n, p in trainer.model.named_parameters())
    assert (trainer.logprobs(samples[:1])[0] == mine).all()
    assert abs(theirs - mine).max() > 1e-3  # the held version did run


def test_a_checkpoint_with_dropout_is_stepped_on_the_policy_nodes_sample(tmp_path):
    """A checkpoint shipped with dropout > 0: the step's (train-mode) forward must score what nodes
    sampled from, without dropout, or every honest token would look mismatched and the in-step
    verification, which reads the same logits, would strike honest nodes (issue 55, point 9)."""
    from dataclasses import replace

    from tests.support.tiny_model import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt", "llama", init_std=0.3, attention_dropout=0.5)
    trainer = Trainer(checkpoint, TrainerConfig(lora_rank=4, lora_init="random", threads=1), 1.0)
    samples = samples_for(trainer)
    honest = [replace(s, behaviour=tuple(float(x) for x in lp)) for s, lp in zip(samples, trainer.logprobs(samples))]
    stats = trainer.step(honest)
    assert stats.tokens > 0 and stats.mismatch_kl < 1e-9 and abs(stats.mean_log_ratio) < 1e-6, stats
