"""Environments the swarm trains on. Pure Python: no torch, no network.

- `base`        the `Task` interface and the `Problem` a seed turns into
- `arithmetic`  seeded arithmetic word problems with a final-integer verifier
- `registry`    task names -> classes, so a RunManifest's TaskSpec picks the environment

Nodes build prompts from a seed; the trainer regenerates the same problem from the seed and
re-runs the verifier, so a node's claimed reward is never trusted.
"""

from tasks.base import Problem, Task
from tasks.registry import make_task

__all__ = ["Problem", "Task", "make_task"]
