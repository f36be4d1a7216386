"""Environments the swarm trains on. Pure Python: no torch, no network.

- `base`        the environment API: a `Task` makes an `Episode` from a seed; `SingleTurnTask`
                for tasks answered in one reply (`generate` a `Problem`, `reward` a completion)
- `registry`    task names -> classes: built-ins, `echo_swarm.tasks` entry points, `module:Class`
- `arithmetic`  seeded arithmetic problems (the `make demo` task)
- `answers`     reading a final answer as an exact number (every math verifier uses it)
- `maths`       "math": multi-step word problems, arithmetic, or a user's JSONL / HF dataset
- `sokoban`     "sokoban": generated solvable levels, played over several turns
- `knights`     "kk": knights-and-knaves puzzles with a unique solution

See docs/tasks.md for each task's prompt, scoring and a scored transcript.

The trainer renders every prompt and recomputes every reward by replaying the episode from the
seed and the model's turns, so a node's claimed reward is never trusted. Nodes step multi-turn
environments themselves, to write the environment's turns into the transcript.
"""

from tasks.base import Episode, Problem, SingleTurnTask, Step, Task
from tasks.registry import TaskError, make_task

__all__ = ["Episode", "Problem", "SingleTurnTask", "Step", "Task", "TaskError", "make_task"]
