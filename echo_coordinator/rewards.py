"""Rewards, recomputed by the trainer: replay each sample's episode from its seed and the model's
turns, check every environment turn the node wrote, and score the episode. Nothing a node says
about rewards or observations is trusted.

The replay mirrors the node's loop (`echo_node.episodes`): model and environment turns alternate,
starting and ending with the model; a model turn is at most `max_new_tokens` tokens and its text,
without a final end-of-turn token, is the action; no turn follows a Step that said done or the
task's `max_turns`-th model turn. A single-turn sample is one model turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protocols.errors import TranscriptError
from protocols.messages import RolloutSample, Segment, TurnFormat
from tasks import Step, Task


@dataclass(frozen=True)
class Transcripts:
    """What replaying needs of the run: the tokenizer's decode and the chat format."""

    decode: Callable[[Sequence[int]], str]  # ids -> text, special tokens written out
    eos: int  # the end-of-turn token id
    turns: TurnFormat
    max_new_tokens: int  # per model turn

    @classmethod
    def of(cls, tokenizer, turns: TurnFormat, max_new_tokens: int) -> Transcripts:
        """The rules for an HF tokenizer: decode writes special tokens out, as nodes' backends do."""
        return cls(decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False,
                                                       clean_up_tokenization_spaces=False),
                   eos=tokenizer.eos_token_id, turns=turns, max_new_tokens=max_new_tokens)


def score(task: Task, sample: RolloutSample, rules: Transcripts) -> float:
    episode = task.episode(sample.seed)
    segments = sample.segments or (Segment("model", len(sample.completion_ids)),)
    if segments[-1].role != "model":
        raise TranscriptError(f"seed {sample.seed}: the transcript must end with a model turn")
    position, turns = 0, 0
    step, stopped = Step("", 0.0, False), False
    for i, segment in enumerate(segments):
        ids = sample.completion_ids[position : position + segment.length]
        position += segment.length
        if segment.role != ("model" if i % 2 == 0 else "env"):
            raise TranscriptError(f"seed {sample.seed}: turn {i} should be the {'model' if i % 2 == 0 else 'env'}'s")
        if segment.role == "env":
            if step.done or turns == task.max_turns:
                raise TranscriptError(f"seed {sample.seed}: an environment turn after the episode ended")
            if rules.decode(ids) != rules.turns.env_text(step.observation, stopped):
                raise TranscriptError(f"seed {sample.seed}: environment turn {i} is not what the environment replied")
            continue
        if len(ids) > rules.max_new_tokens:
            raise TranscriptError(f"seed {sample.seed}: a model turn of {len(ids)} tokens exceeds {rules.max_new_tokens}")
        stopped = ids[-1] == rules.eos
        step = episode.step(rules.decode(ids[:-1] if stopped else ids))
        turns += 1
    return episode.score()
