"""Multi-turn rollouts: the node plays the run's environment with its own model.

After the trainer-rendered prompt the transcript alternates model turns (sampled, with behaviour
logprobs; trained: loss mask 1) and environment turns (the observation written in the run's chat
`TurnFormat` and tokenized here; logprob 0, loss mask 0). The trainer replays the episode from the
seed and the model turns (`echo_coordinator.rewards`) and refuses a transcript whose environment
turns differ, so this loop and that replay must agree turn for turn:

- a model turn is at most `max_new_tokens` tokens; its text, without a final end-of-turn token and
  with any other special token written out, is the action;
- the episode ends after a Step that says done, or after `max_turns` model turns;
- otherwise the environment's turn follows, unless the context window is full (the transcript then
  ends early and is scored as it stands).
"""

from __future__ import annotations

from protocols.messages import RolloutSample, Segment, TurnFormat
from tasks import Episode

MIN_TURN_ROOM = 16  # tokens a model turn needs to be worth starting


def play(backend, episode: Episode, seed: int, prompt: tuple[int, ...], turns: TurnFormat, max_turns: int,
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
        stopped = out.token_ids[-1] == backend.eos
        step = episode.step(backend.detokenize(out.token_ids[:-1] if stopped else out.token_ids))
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
