"""A lease's batch: G samples of each prompt in order, each with its own noise seed (greedy: none),
stamped with the version held, signed by the node; a multi-turn run needs its environment here."""

import sys
import threading

import pytest

from echo_node.config import JoinRefused, Stopped
from echo_node.rollouts import Rollouts, load_task
from engines.backend import Completion, Interrupted
from protocols import sampling
from protocols.errors import InvalidValue
from protocols.messages import TaskSpec
from protocols.signing import verify_message
from tests.support.envs import MoreE
from tests.unit.protocols import factories


class Backend:
    """Records what it was asked to sample; `stop`: interrupted, as llama.cpp's backend is when
    the node's stop event is set."""

    vocab_size = 100

    def __init__(self, stop: threading.Event | None = None):
        self.asked, self.stop = [], stop

    def generate(self, requests, temperature, follow=None):
        if self.stop is not None and self.stop.is_set():
            raise Interrupted("generation interrupted")
        self.asked += [(r.prompt_ids, r.seed) for r in requests]
        return [Completion(token_ids=(9, 10), logprobs=(-0.5, -0.25)) for _ in requests]


def test_a_batch_is_g_samples_per_prompt_each_with_the_verifiers_seed(session):
    manifest = factories.manifest(group_size=3)
    backend = Backend()
    lease = factories.lease(lease_id="L7", seeds=(5, 6), prompts=((1, 2), (3,)))
    batch = Rollouts(session, manifest, backend).generate(lease, version=4)
    assert [p for p, _ in backend.asked] == [(1, 2)] * 3 + [(3,)] * 3  # each prompt's group together
    noise = [s for _, s in backend.asked]
    assert noise == sampling.sample_seeds("L7", [5, 5, 5, 6, 6, 6]) and len(set(noise)) == 6
    assert [s.seed for s in batch.samples] == [5, 5, 5, 6, 6, 6]
    assert (batch.lease_id, batch.version, batch.run_id) == ("L7", 4, manifest.run_id)
    verify_message(batch, session.node_key)  # signed by this node's key


def test_an_evaluation_lease_names_its_own_count_and_greedy_needs_no_noise(session):
    backend = Backend()
    lease = factories.lease(seeds=(5,), prompts=((1,),), evaluation=True, samples=2, greedy=True)
    batch = Rollouts(session, factories.manifest(group_size=8), backend).generate(lease, version=0)
    assert len(batch.samples) == 2 and [s for _, s in backend.asked] == [None, None]


def test_a_stop_ends_generation(session):
    backend = Backend(session.stop_requested)
    session.stop_requested.set()
    with pytest.raises(Stopped):
        Rollouts(session, factories.manifest(group_size=4), backend).generate(factories.lease(), version=0)
    assert backend.asked == []


def test_multi_turn_runs_need_the_environment_here():
    more_e = factories.manifest(task=TaskSpec("tests.support.envs:MoreE", {"max_turns": 2}, max_turns=2))
    assert load_task(more_e, frozenset({"tests.support.envs:MoreE"})) == MoreE(max_turns=2)
    with pytest.raises(JoinRefused, match="install the package that provides 'their_pkg.envs:Maze'"):
        load_task(factories.manifest(task=TaskSpec("their_pkg.envs:Maze", {}, max_turns=3)), frozenset({"their_pkg.envs:Maze"}))
    assert load_task(factories.manifest(task=TaskSpec("sokoban", {}, max_turns=3))).max_turns > 1  # built in


def test_a_coordinator_cannot_make_a_node_import_code_or_read_files():
    """A hostile coordinator's task spec: an arbitrary module (importing runs its code) unless the
    operator allowed it, or a single-turn task whose parameters name a file ("/dev/zero" would be
    read until memory ran out), claimed multi-turn so the node would build it."""
    with pytest.raises(JoinRefused, match="--allow-task this:Anything"):
        load_task(factories.manifest(task=TaskSpec("this:Anything", {}, max_turns=2)))  # `this` prints on import
    assert "this" not in sys.modules
    with pytest.raises(JoinRefused, match="single-turn task 'math'"):
        load_task(factories.manifest(task=TaskSpec("math", {"dataset": "/dev/zero"}, max_turns=2)))


def test_a_prompt_token_outside_the_models_vocabulary_is_refused_before_generation(session):
    """A coordinator's prompt ids go into llama.cpp's embedding lookup: one past the vocabulary
    would be read out of bounds."""
    backend = Backend()
    lease = factories.lease(seeds=(5,), prompts=((1, 100),))
    with pytest.raises(InvalidValue, match="outside this model's 100 ids"):
        Rollouts(session, factories.manifest(group_size=2), backend).generate(lease, version=0)
    assert backend.asked == []
