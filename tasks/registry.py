"""Task names to environments. A RunManifest's TaskSpec(name, params) picks one.

A name is, in this order: a built-in task; an entry point in the `echo_swarm.tasks` group (a
package's `[project.entry-points."echo_swarm.tasks"] mytask = "mypkg.envs:MyTask"`); or a dotted
path `module:Class` to an importable class. Whatever it names must be a `tasks.Task` subclass, so
a name can only ever construct an environment, never call arbitrary code with the params.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from tasks.arithmetic import ArithmeticTask
from tasks.base import Task
from tasks.knights import KnightsTask
from tasks.maths import MathTask
from tasks.sokoban import SokobanTask

ENTRY_POINT_GROUP = "echo_swarm.tasks"
TASKS: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "math": MathTask, "sokoban": SokobanTask, "kk": KnightsTask}


class TaskError(ValueError):
    """A task name that resolves to nothing usable, or parameters its constructor refuses."""


def task_class(name: str) -> type[Task]:
    if name in TASKS:
        found: Any = TASKS[name]
    elif plugins := entry_points(group=ENTRY_POINT_GROUP, name=name):
        found = _load(name, lambda: next(iter(plugins)).load())
    elif ":" in name:
        module, _, attr = name.partition(":")
        found = _load(name, lambda: getattr(importlib.import_module(module), attr))
    else:
        raise TaskError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}; or name an "
                        f"'{ENTRY_POINT_GROUP}' entry point, or a class as 'module:Class'")
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise TaskError(f"task {name!r} is {found!r}, not a subclass of tasks.Task")
    return found


def _load(name: str, load) -> Any:
    try:
        return load()
    except (ImportError, AttributeError) as e:
        raise TaskError(f"cannot load task {name!r}: {e}") from None


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    cls = task_class(name)
    try:
        task = cls(**(params or {}))
        task.episode(0)  # parameters no episode can satisfy fail here, at start, not in every lease
    except (TypeError, ValueError) as e:
        raise TaskError(f"bad parameters for task {name!r}: {e}") from None
    return task
