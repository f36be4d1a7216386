"""Episodes, played by a node and replayed by the trainer, under one set of turn rules.

After the trainer-rendered prompt the transcript alternates model turns (sampled, with behaviour
logprobs; trained: loss mask 1) and environment turns (the observation written in the run's chat
`TurnFormat`; logprob 0, loss mask 0). The trainer replays every episode from its seed and the
model's turns (`score`) and refuses a transcript whose environment turns differ from what the
environment replies, token for token, so `Game` and `score` share these rules:

- a model turn ends at its end-of-turn token or at its token limit (`max_new_tokens`, less when
  the context window is nearly full), nowhere else; its text, without a final end-of-turn token and
  with any other special token written out, is the action (`action_text`);
- the transcript starts and ends with a model turn; the episode ends after a Step that says done,
  or after `max_turns` model turns;
- otherwise the environment's turn follows, unless the context window is full (the transcript then
  ends early and is scored as it stands). The window is the run's (`context_window`), not the
  node's choice, so the trainer knows where a transcript had to end: a node that cuts a turn or an
  episode short (after the gold answer, say) is refused (`Truncated`).

A single-turn sample is one model turn (`rollouts` picks the path; nobody else branches on it).
A lease's samples are generated together: the backend decodes as many at once as it can, and
multi-turn episodes (`Game`) step their environments as each turn ends, while others decode.
Nothing a node says about rewards or observations is trusted: `score` recomputes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engines.backend import Backend, Completion, Request
from engines.hf import decode
from protocols.errors import TranscriptError, Truncated
from protocols.messages import RolloutSample, Segment, TurnFormat
from tasks import Episode, Step, Task

MIN_TURN_ROOM = 16  # tokens a model turn needs to be worth starting


def context_window(max_new_tokens: int, multi_turn: bool) -> int:
    """Each sequence's context window (prompt and transcript), tokens, on every node of a run."""
    return 4096 if max_new_tokens > 2048 or multi_turn else 2048


def turn_limit(max_new_tokens: int, window: int, used: int) -> int:
    """The most tokens a model turn may take after `used` tokens of prompt and transcript."""
    return min(max_new_tokens, window - used)


def action_text(decode: Callable[[Sequence[int]], str], ids: Sequence[int], eos: int) -> tuple[str, bool]:
    """A model turn's action and whether it ended at the end-of-turn token (which is not part of it)."""
    stopped = bool(ids) and ids[-1] == eos
    return decode(ids[:-1] if stopped else ids), stopped


def rollouts(backend: Backend, task: Task | None, items: Sequence[tuple[int, tuple[int, ...], int | None]],
             turns: TurnFormat, max_new_tokens: int, temperature: float) -> list[RolloutSample]:
    """A sample of each (episode seed, prompt, sample seed (None: greedy)), generated together:
    whole episodes of a multi-turn `task`, else one model turn each (None: a single-turn run,
    which a node needs no environment for: the trainer renders prompts)."""
    if task is None or task.max_turns <= 1:
        requests = [Request(prompt, max_new_tokens, sample_seed) for _, prompt, sample_seed in items]
        outs = backend.generate(requests, temperature)
        return [RolloutSample(seed=seed, prompt_ids=prompt, completion_ids=out.token_ids, logprobs=out.logprobs)
                for (seed, prompt, _), out in zip(items, outs)]
    games = [Game(backend, task.episode(seed), seed, prompt, turns, task.max_turns, max_new_tokens, sample_seed)
             for seed, prompt, sample_seed in items]
    backend.generate([g.request() for g in games], temperature, lambda index, out: games[index].after(out))
    return [g.sample() for g in games]


class Game:
    """One multi-turn episode as the backend plays it: `request` is the next model turn, `after`
    takes its completion, steps the environment and returns the turn after (None: the episode is over)."""

    def __init__(self, backend: Backend, episode: Episode, seed: int, prompt: tuple[int, ...], turns: TurnFormat,
                 max_turns: int, max_new_tokens: int, sample_seed: int | None):
        self.backend, self.episode, self.seed, self.prompt, self.turns = backend, episode, seed, prompt, turns
        self.max_turns, self.max_new_tokens, self.sample_seed = max_turns, max_new_tokens, sample_seed
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[Segment] = []
        self.turn = 0

    def request(self) -> Request:
        limit = turn_limit(self.max_new_tokens, self.backend.n_ctx, len(self.prompt) + len(self.ids))
        # Noise is keyed by completion position, env tokens included, as the trainer re-derives it.
        return Request(self.prompt + tuple(self.ids), limit, self.sample_seed, offset=len(self.ids))

    def after(self, out: Completion) -> Request | None:
        self.ids += out.token_ids
        self.logprobs += out.logprobs
        self.segments.append(Segment("model", len(out.token_ids)))
        action, stopped = action_text(self.backend.detokenize, out.token_ids, self.backend.eos)
        step = self.episode.step(action)
        self.turn += 1
        if step.done or self.turn == self.max_turns:
            return None
        reply = self.backend.tokenize(self.turns.env_text(step.observation, stopped))
        if len(self.prompt) + len(self.ids) + len(reply) + MIN_TURN_ROOM > self.backend.n_ctx:
            return None
        self.ids += reply
        self.logprobs += [0.0] * len(reply)
        self.segments.append(Segment("env", len(reply)))
        return self.request()

    def sample(self) -> RolloutSample:
        return RolloutSample(seed=self.seed, prompt_ids=self.prompt, completion_ids=tuple(self.ids),
                             logprobs=tuple(self.logprobs), segments=tuple(self.segments))


@dataclass(frozen=True)
class Transcripts:
    """What replaying needs of the run: the tokenizer's decode and the chat format."""

    decode: Callable[[Sequence[int]], str]  # ids -> text, special tokens written out
    encode: Callable[[str], Sequence[int]]  # text -> ids, as nodes tokenize an environment turn
    eos: int  # the end-of-turn token id
    turns: TurnFormat
    max_new_tokens: int  # per model turn
    window: int = 2048  # the run's context window (`context_window`)

    @classmethod
    def of(cls, tokenizer, turns: TurnFormat, max_new_tokens: int, window: int) -> Transcripts:
        """The rules for an HF tokenizer: decode writes special tokens out, as nodes' backends do."""
        return cls(decode=lambda ids: decode(tokenizer, ids),
                   encode=lambda text: tokenizer(text, add_special_tokens=False).input_ids,
                   eos=tokenizer.eos_token_id, turns=turns, max_new_tokens=max_new_tokens, window=window)


def score(task: Task, sample: RolloutSample, rules: Transcripts) -> float:
    """Replay `sample`'s episode from its seed and its model turns; its reward, or TranscriptError."""
    episode = task.episode(sample.seed)
    segments = sample.segments or (Segment("model", len(sample.completion_ids)),)
    if segments[-1].role != "model":
        raise TranscriptError(f"seed {sample.seed}: the transcript must end with a model turn")
    position, turns = 0, 0
    step, stopped = Step("", 0.0, False), False
    for i, segment in enumerate(segments):
        used = len(sample.prompt_ids) + position  # tokens before this turn
        ids = sample.completion_ids[position : position + segment.length]
        position += segment.length
        if segment.role != ("model" if i % 2 == 0 else "env"):
            raise TranscriptError(f"seed {sample.seed}: turn {i} should be the {'model' if i % 2 == 0 else 'env'}'s")
        if segment.role == "env":
            if step.done or turns == task.max_turns:
                raise TranscriptError(f"seed {sample.seed}: an environment turn after the episode ended")
            # Token for token, not text for text: written with other ids, the same text would
            # shift every later noise position, and a node could search among outcomes.
            if tuple(ids) != tuple(rules.encode(rules.turns.env_text(step.observation, stopped))):
                raise TranscriptError(f"seed {sample.seed}: environment turn {i} is not what the environment replied, "
                                      "tokenized as the run's tokenizer does")
            continue
        check_turn_end(sample.seed, ids, turn_limit(rules.max_new_tokens, rules.window, used), rules.eos)
        action, stopped = action_text(rules.decode, ids, rules.eos)
        step = episode.step(action)
        turns += 1
    if not step.done and turns < task.max_turns:
        # Only a full window ends an unfinished episode: the next environment turn and a model turn
        # would not fit. Its tokens are counted as UTF-8 bytes, never fewer than the node's tokenizer
        # makes of them, so an honest node always passes and a cheat may stop only at the window's edge.
        reply = len(rules.turns.env_text(step.observation, stopped).encode())
        if len(sample.prompt_ids) + position + reply + MIN_TURN_ROOM <= rules.window:
            raise Truncated(f"seed {sample.seed}: the episode stops after turn {turns} of {task.max_turns}, "
                            "while the environment had not ended it and the window had room")
    return episode.score()


def check_turn_end(seed: int, ids: Sequence[int], limit: int, eos: int) -> None:
    """Refuse a model turn that does not end where sampling stops: at its first end-of-turn token,
    or at `limit` tokens."""
    if len(ids) > limit:
        raise TranscriptError(f"seed {seed}: a model turn of {len(ids)} tokens exceeds its limit of {limit}")
    if eos in ids[:-1]:
        raise Truncated(f"seed {seed}: a model turn goes on past its end-of-turn token")
    if len(ids) < limit and (not ids or ids[-1] != eos):
        raise Truncated(f"seed {seed}: a model turn of {len(ids)} tokens stops before its end-of-turn token "
                        f"and its limit of {limit}")
