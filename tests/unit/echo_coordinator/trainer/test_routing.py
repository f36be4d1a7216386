"""Verification of a mixture of experts under routing flips, on a tiny random Qwen3-MoE trainer:
a sample whose one token was chosen under the other routing of a near tie (what a quantized node
does) passes, and only because of the re-check; a written token at the same place does not."""

import dataclasses

import numpy as np
import pytest
import torch

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer import evidence
from echo_coordinator.trainer.learner import Trainer
from echo_coordinator.trainer.routing import Routing, routers
from echo_coordinator.trainer.samples import TrainSample
from engines.sampler import sample_rows, score_rows
from protocols.sampling import SamplingRule, log_softmax
from tests.support.tiny_model import build_tiny_checkpoint

RULE = SamplingRule()
PROMPT = tuple(range(300, 316))
LENGTH = 24


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "checkpoint", "qwen3_moe", init_std=0.2)
    trainer = Trainer(checkpoint, TrainerConfig(lora_rank=4, threads=1), temperature=1.0)
    trainer.model.eval()
    return trainer


def forward(trainer, ids: tuple[int, ...]) -> np.ndarray:
    causal = trainer.causal
    with torch.no_grad():
        return causal(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def sample(trainer, seed: int) -> tuple[int, ...]:
    """The tokens the trainer's own weights sample with `seed`'s noise (a node with no rounding)."""
    ids = PROMPT
    for j in range(LENGTH):
        [token], _ = sample_rows(forward(trainer, ids)[-1:], 1.0, [seed], [j])
        ids += (int(token),)
    return ids[len(PROMPT):]


def routing_flipped_sample(trainer) -> tuple[TrainSample, int]:
    """A sample whose last token an honest node routing one near tie the other way chose, and
    which the trainer's own routing finds an outlier; its seed."""
    with Routing(trainer.model) as routing:
        for seed in range(20):
            tokens = sample(trainer, seed)
            plain = forward(trainer, PROMPT + tokens)
            ties = routing.near_ties(range(len(PROMPT) - 1, len(PROMPT) - 1 + LENGTH), evidence.NEAR_TIE)
            for flip in ties:
                routing.flip = flip
                flipped = forward(trainer, PROMPT + tokens)  # rows before the flip's are unchanged
                routing.flip = None
                j = flip.row - len(PROMPT) + 1
                [token], _ = sample_rows(flipped[flip.row:flip.row + 1], 1.0, [seed], [j])
                [margin], _ = score_rows(plain[flip.row:flip.row + 1], [seed], np.array([j]), np.array([token]))
                if margin > RULE.max_margin:
                    ids = tokens[:j] + (int(token),)
                    logprobs = log_softmax(flipped[len(PROMPT) - 1:flip.row + 1])[np.arange(j + 1), ids]
                    return TrainSample(PROMPT, ids, tuple(logprobs), (1,) * (j + 1), 0.0, 0), seed
    raise AssertionError("no near tie in 20 samples makes an outlier")


def test_routing_hooks_see_each_token_and_flip_one(trainer):
    assert len(routers(trainer.model)) == 2
    ids = PROMPT + (400, 401)
    with Routing(trainer.model) as routing:
        plain = forward(trainer, ids)
        assert [p.shape for p in routing.probs] == [(len(ids), 4)] * 2
        [flip] = routing.near_ties([len(ids) - 1], float("inf"))[:1]
        routing.flip = flip
        flipped = forward(trainer, ids)
    assert np.array_equal(flipped[: flip.row], plain[: flip.row])  # earlier tokens do not see it
    assert np.abs(flipped[flip.row] - plain[flip.row]).max() > 1e-3
    assert np.array_equal(forward(trainer, ids), plain)  # the hooks are gone


def test_a_token_of_the_other_routing_passes_only_by_the_recheck(trainer, monkeypatch):
    made, seed = routing_flipped_sample(trainer)
    j = len(made.completion_ids) - 1
    [found] = evidence.measure(trainer, [made], [seed])
    assert not RULE.outlier(found), found
    with monkeypatch.context() as m:  # without the re-check: the honest sample is an outlier
        m.setattr(evidence, "routers", lambda model: [])
        [plain] = evidence.measure(trainer, [made], [seed])
    assert RULE.outlier(plain) and plain.max_margin > found.max_margin
    # A written token at the same place, one neither routing samples: still an outlier.
    logits = forward(trainer, PROMPT + made.completion_ids[:j])[-1]
    written = int(np.argmin(logits))
    forged = dataclasses.replace(made, completion_ids=made.completion_ids[:j] + (written,))
    [caught] = evidence.measure(trainer, [forged], [seed])
    assert RULE.outlier(caught) and caught.max_margin > RULE.max_margin
