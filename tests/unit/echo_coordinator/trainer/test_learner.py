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
