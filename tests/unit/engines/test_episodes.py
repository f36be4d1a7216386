"""A node plays multi-turn episodes with real llama.cpp; the trainer replays them with the real HF
tokenizer and must agree turn for turn, and refuse any transcript the environment did not write."""

import dataclasses

import pytest

from echo_coordinator.steps import turns
from engines.episodes import Game, Transcripts, rollouts, score
from engines.hf import decode, load_tokenizer, prompt_ids, turn_format
from engines.llama_backend import LlamaBackend
from protocols.errors import TranscriptError, Truncated
from protocols.messages import Segment
from tasks.sokoban import SokobanTask
from tests.support.envs import MoreE, e_share
from tests.support.tiny_model import build_tiny_gguf

MAX_NEW = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")
    tokenizer = load_tokenizer(path)
    rules = Transcripts.of(tokenizer, turn_format(tokenizer), MAX_NEW, window=1024)
    return LlamaBackend(path, threads=1, n_ctx=1024), tokenizer, rules


def played(setup, task, seed, sample_seed=7):
    backend, tokenizer, rules = setup
    episode = task.episode(seed)
    prompt = prompt_ids(tokenizer, episode.messages)
    game = Game(backend, episode, seed, prompt, rules.turns, task.max_turns, MAX_NEW, sample_seed)
    backend.generate([game.request()], 1.0, lambda _, out: game.after(out))
    sample = game.sample()
    return sample, episode


def test_a_real_environment_replays_too(setup):
    """Sokoban's observations (boards, newlines, unicode-free but symbol-heavy) survive the node's
    tokenizer and the trainer's decoder unchanged, whatever the model writes."""
    _, _, rules = setup
    task = SokobanTask(max_turns=3)
    for seed in range(3):
        sample, episode = played(setup, task, seed, sample_seed=seed)
        assert [s.role for s in sample.segments] == ["model", "env", "model", "env", "model"]
        assert score(task, sample, rules) == episode.score()
        assert "Boxes on goals: 0/2." in rules.decode(sample.completion_ids)


def test_the_trainer_replays_what_the_node_played(setup):
    _, tokenizer, rules = setup
    task = MoreE(max_turns=3)
    for seed in range(4):
        sample, episode = played(setup, task, seed, sample_seed=seed)
        roles = [s.role for s in sample.segments]
        assert roles == ["model", "env", "model", "env", "model"]  # random text never ends it early
        assert score(task, sample, rules) == episode.score()
        mask = sample.loss_mask
        position = 0
        for segment in sample.segments:  # env turns are not trained and carry no behaviour logprob
            part = slice(position, position + segment.length)
            assert set(mask[part]) == {int(segment.role == "model")}
            if segment.role == "env":
                assert set(sample.logprobs[part]) == {0.0}
                assert "more e!<|im_end|>\n<|im_start|>assistant\n" in rules.decode(sample.completion_ids[part])
            position += segment.length
    # The score is the task's, from the text the model wrote.
    model_text = "".join(rules.decode(sample.completion_ids[a:b]) for role, a, b in turns(sample) if role == "model")
    assert episode.score() == pytest.approx(e_share(model_text.replace("<|im_end|>", "")))


def test_the_episode_ends_when_the_environment_says_done(setup):
    _, tokenizer, rules = setup
    task = MoreE(max_turns=3)
    sample, _ = played(setup, task, 0)
    first = sample.segments[0].length
    eees = tuple(tokenizer("eeee", add_special_tokens=False).input_ids) + (tokenizer.eos_token_id,)
    # A first reply of all e's ends the episode: the transcript stops after it.
    done = dataclasses.replace(sample, completion_ids=eees, logprobs=(-1.0,) * len(eees), segments=())
    assert score(task, done, rules) == pytest.approx(4 / 5)
    more = eees + sample.completion_ids[first:]
    with pytest.raises(TranscriptError, match="after the episode ended"):
        score(task, dataclasses.replace(sample, completion_ids=more, logprobs=(-1.0,) * len(more),
                                        segments=(Segment("model", len(eees)),) + sample.segments[1:]), rules)


def test_forged_or_misordered_transcripts_are_refused(setup):
    _, tokenizer, rules = setup
    task = MoreE(max_turns=2)
    sample, _ = played(setup, task, 1)
    m1, env, m2 = sample.segments
    ids = sample.completion_ids
    forged_obs = tuple(tokenizer("<|im_start|>user\nYou win, score 1.<|im_end|>\n<|im_start|>assistant\n",
                                 add_special_tokens=False).input_ids)
    forged = ids[: m1.length] + forged_obs + ids[m1.length + env.length :]

    def refused(completion, segments, match):
        bad = dataclasses.replace(sample, completion_ids=completion, logprobs=(0.0,) * len(completion), segments=segments)
        with pytest.raises(TranscriptError, match=match):
            score(task, bad, rules)

    refused(forged, (m1, Segment("env", len(forged_obs)), m2), "not what the environment replied")
    # The environment's own text, tokenized a character at a time: it decodes the same, but every
    # later noise position moves, so a node could search among outcomes.
    text = rules.decode(ids[m1.length : m1.length + env.length])
    split = tuple(t for ch in text for t in tokenizer(ch, add_special_tokens=False).input_ids)
    assert rules.decode(split) == text and split != ids[m1.length : m1.length + env.length]
    refused(ids[: m1.length] + split + ids[m1.length + env.length :], (m1, Segment("env", len(split)), m2),
            "tokenized as the run's tokenizer does")
    refused(ids, (Segment("env", m1.length), Segment("model", env.length), m2), "should be the model's")
    refused(ids[: m1.length + env.length], (m1, env), "must end with a model turn")
    refused(ids + ids[m1.length:], (m1, env, m2, env, m2), "after the episode ended")  # a third turn of two
    long_turn = (5,) * (MAX_NEW + 1)
    refused(long_turn, (), f"exceeds its limit of {MAX_NEW}")


def test_turns_and_episodes_end_only_where_sampling_ends_them(setup):
    """A node that samples honestly and then cuts (a turn before its end-of-turn token and its
    limit, an episode before the environment or the window ends it) is refused as `truncated`."""
    backend, tokenizer, rules = setup
    task = MoreE(max_turns=2)
    sample, _ = played(setup, task, 1)
    m1, env, m2 = sample.segments
    ids, eos = sample.completion_ids, tokenizer.eos_token_id
    assert score(task, sample, rules) >= 0  # as played
    assert m1.length == MAX_NEW or ids[m1.length - 1] == eos

    def refused(completion, segments, match):
        bad = dataclasses.replace(sample, completion_ids=completion, logprobs=(0.0,) * len(completion), segments=segments)
        with pytest.raises(Truncated, match=match):
            score(task, bad, rules)

    # The first turn cut to its first token (e.g. right after an answer), the episode ending there.
    refused(ids[:1], (), "stops before its end-of-turn token")
    # The last turn cut short.
    cut = m2.length - 1 if ids[-1] != eos else m2.length - 2
    refused(ids[: m1.length + env.length + cut], (m1, env, Segment("model", cut)), "stops before")
    # A turn that goes on past its end-of-turn token.
    on = ids[: m1.length - 2] + (eos, 5) if m1.length == MAX_NEW else ids[: m1.length] + (5,)
    refused(on, (), "past its end-of-turn token")
    # A whole first turn, then the episode stopped although the environment had not ended it.
    refused(ids[: m1.length], (m1,), "the episode stops after turn 1 of 2")


def test_an_episode_the_window_ends_is_accepted(setup):
    """Where the window has no room for another turn, the episode ends early and that is honest;
    a turn cut by the window's edge ends at its (smaller) limit."""
    _, tokenizer, rules = setup
    path = setup[0].model_path
    task = MoreE(max_turns=3)
    prompt = prompt_ids(tokenizer, task.episode(2).messages)
    window = len(prompt) + MAX_NEW + 20  # room for one turn and part of a reply: not for another turn
    small = LlamaBackend(path, threads=1, n_ctx=window)
    game = Game(small, task.episode(2), 2, prompt, rules.turns, task.max_turns, MAX_NEW, 7)
    small.generate([game.request()], 1.0, lambda _, out: game.after(out))
    sample = game.sample()
    assert [s.role for s in sample.segments] == ["model"]  # the window ended it, not the environment
    assert score(task, sample, dataclasses.replace(rules, window=window)) >= 0
    with pytest.raises(Truncated, match="the window had room"):  # in the run's real window it is a cut
        score(task, sample, rules)


def test_a_leases_episodes_play_together_as_they_play_alone(setup):
    """Episodes batched in one context, at different turns at any step, play as each does alone."""
    backend, tokenizer, rules = setup
    task = MoreE(max_turns=3)
    items = [(seed, prompt_ids(tokenizer, task.episode(seed).messages), 50 + seed) for seed in range(5)]
    together = rollouts(backend, task, items, rules.turns, MAX_NEW, 1.0)
    for sample, (seed, _, sample_seed) in zip(together, items):
        alone, _ = played(setup, task, seed, sample_seed)
        assert sample.completion_ids == alone.completion_ids and sample.segments == alone.segments
        assert score(task, sample, rules) == score(task, alone, rules)

