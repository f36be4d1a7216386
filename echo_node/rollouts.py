"""Generating a lease's batch: G samples of each of its prompts (an evaluation lease names its own
count), each with the per-sample noise seed the verifier derives too, then signed."""

from __future__ import annotations

import time

from echo_node.config import JoinRefused, Stopped
from echo_node.session import Session
from engines.backend import Interrupted
from engines.episodes import rollouts
from protocols import sampling
from protocols.errors import InvalidValue
from protocols.messages import RolloutBatch, RunManifest, TaskLease
from protocols.signing import sign_message
from tasks import SingleTurnTask, TaskError, make_task
from tasks.registry import task_class


def load_task(manifest: RunManifest, allowed: frozenset[str] = frozenset()):
    """A multi-turn run's environment, which this node steps itself. Single-turn runs need none:
    the trainer sends rendered prompts. The coordinator names it, so it chooses code this node
    runs: a `module:Class` only if the operator `allowed` it (importing it runs the module), and
    never a single-turn task (the built-in `math` reads a file the coordinator would name)."""
    name = manifest.task.name
    if ":" in name and name not in allowed:
        raise JoinRefused(f"this run's environment {name!r} is code the coordinator names; if you trust it, "
                          f"join again with --allow-task {name}")
    try:
        cls = task_class(name)
        if issubclass(cls, SingleTurnTask):
            raise JoinRefused(f"this run claims the single-turn task {name!r} is multi-turn; a node steps "
                              "multi-turn environments only")
        return make_task(name, manifest.task.params)
    except TaskError as e:
        raise JoinRefused(f"this run's environment is not available here ({e}); install the package "
                          f"that provides {name!r}") from None


class Rollouts:
    """Runs in the generation thread: reads the backend, the run and the environment, never
    writes shared state; `stop_requested` ends it (llama.cpp: at the next decoding step)."""

    def __init__(self, session: Session, manifest: RunManifest, backend, task=None):
        self.session, self.manifest, self.backend = session, manifest, backend
        self.task = task  # multi-turn runs: the environment this node steps (`load_task`)

    def generate(self, lease: TaskLease, version: int) -> RolloutBatch:
        """The lease's batch, generated with the weights of `version` (the one the node holds)."""
        if self.session.stop_requested.is_set():
            raise Stopped("stopping")
        # The coordinator renders prompts; an id past the model's vocabulary would make llama.cpp
        # read out of bounds. Refused here, the round is retried (`Work`) and the lease lapses.
        vocab = self.backend.vocab_size
        if any(not 0 <= token < vocab for prompt in lease.prompts for token in prompt):
            raise InvalidValue(f"lease {lease.lease_id} has a prompt token id outside this model's {vocab} ids")
        group = lease.samples if lease.evaluation else self.manifest.group_size
        order = [(seed, prompt) for seed, prompt in zip(lease.seeds, lease.prompts) for _ in range(group)]
        noise = sampling.sample_seeds(lease.noise_id, [seed for seed, _ in order])
        items = [(seed, prompt, None if lease.greedy else sample_seed)  # None: greedy
                 for (seed, prompt), sample_seed in zip(order, noise)]
        m = self.manifest
        try:
            samples = rollouts(self.backend, self.task, items, m.turns, m.max_new_tokens, m.temperature)
        except Interrupted:
            raise Stopped("stopping") from None
        batch = RolloutBatch(
            run_id=self.manifest.run_id, lease_id=lease.lease_id, version=version, node_key=self.session.node_key,
            samples=tuple(samples), created=time.time(),
        )
        return sign_message(batch, self.session.key)
