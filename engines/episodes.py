"""Episodes, played by a node and replayed by the trainer, under one set of turn rules.

After the trainer-rendered prompt the transcript alternates model turns (sampled, with behaviour
logprobs; trained: loss mask 1) and environment turns (the observation written in the run's chat
`TurnFormat`; logprob 0, loss mask 0). The trainer replays every episode from its seed and the
model's turns (`score`) and refuses a transcript whose environment turns differ from what the
environment replies, so `play` and `score` share these rules:

- a model turn is at most `max_new_tokens` tokens; its text, without a final end-of-turn token and
  with any other special token written out, is the action (`action_text`);
- the transcript starts and ends with a model turn; the episode ends after a Step that says done,
  or after `max_turns` model turns;
- otherwise the environment's turn follows, unless the context window is full (the transcript then
  ends early and is scored as it stands).

A single-turn sample is one model turn (`rollout` picks the path; nobody else branches on it).
Nothing a node says about rewards or observations is trusted: `score` recomputes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engines.backend import Backend
from engines.hf import decode
from protocols.errors import TranscriptError
from protocols.messages import RolloutSample, Segment, TurnFormat
from tasks import Episode, Step, Task

MIN_TURN_ROOM = 16  # tokens a model turn needs to be worth starting


def action_text(decode: Callable[[Sequence[int]], str], ids: Sequence[int], eos: int) -> tuple[str, bool]:
    """A model turn's action and whether it ended at the end-of-turn token (which is not part of it)."""
    stopped = bool(ids) and ids[-1] == eos
    return decode(ids[:-1] if stopped else ids), stopped


def rollout(backend: Backend, task: Task | None, seed: int, prompt: tuple[int, ...], turns: TurnFormat,
            max_new_tokens: int, temperature: float, sample_seed: int | None) -> RolloutSample:
    """One sample of episode `seed`: the whole episode of a multi-turn `task`, else one model turn
    (None: a single-turn run, which a node needs no environment for: the trainer renders prompts)."""
    if task is not None and task.max_turns > 1:
        return play(backend, task.episode(seed), seed, prompt, turns, task.max_turns, max_new_tokens, temperature,
                    sample_seed)
    out = backend.generate(list(prompt), max_new_tokens, temperature, sample_seed)
    return RolloutSample(seed=seed, prompt_ids=prompt, completion_ids=out.token_ids, logprobs=out.logprobs)


def play(backend: Backend, episode: Episode, seed: int, prompt: tuple[int, ...], turns: TurnFormat, max_turns: int,
         max_new_tokens: int, temperature: float, sample_seed: int | None) -> RolloutSample:
    ids: list[int] = []
    logprobs: list[float] = []
    segments: list[Segment] = []
    for turn in range(max_turns):
        room = backend.n_ctx - len(prompt) - len(ids)
        # Noise is keyed by completion position, env tokens included, as the trainer re-derives it.
        out = backend.generate(list(prompt) + ids, min(max_new_tokens, room), temperature, sample_seed, offset=len(ids))
        ids += out.token_ids
        logprobs += out.logprobs
        segments.append(Segment("model", len(out.token_ids)))
        action, stopped = action_text(backend.detokenize, out.token_ids, backend.eos)
        step = episode.step(action)
        if step.done or turn == max_turns - 1:
            break
        reply = backend.tokenize(turns.env_text(step.observation, stopped))
        if len(prompt) + len(ids) + len(reply) + MIN_TURN_ROOM > backend.n_ctx:
            break
        ids += reply
        logprobs += [0.0] * len(reply)
        segments.append(Segment("env", len(reply)))
    return RolloutSample(seed=seed, prompt_ids=prompt, completion_ids=tuple(ids), logprobs=tuple(logprobs),
                         segments=tuple(segments))


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
        return cls(decode=lambda ids: decode(tokenizer, ids), eos=tokenizer.eos_token_id, turns=turns,
                   max_new_tokens=max_new_tokens)


def score(task: Task, sample: RolloutSample, rules: Transcripts) -> float:
    """Replay `sample`'s episode from its seed and its model turns; its reward, or TranscriptError."""
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
        action, stopped = action_text(rules.decode, ids, rules.eos)
        step = episode.step(action)
        turns += 1
    return episode.score()
