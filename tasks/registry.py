"""Task names to environments. A RunManifest's TaskSpec(name, params) picks one."""

from __future__ import annotations

from typing import Any

from tasks.arithmetic import ArithmeticTask
from tasks.base import Task

TASKS: dict[str, type] = {"arithmetic": ArithmeticTask}


class UnknownTask(ValueError):
    pass


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    if name not in TASKS:
        raise UnknownTask(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    try:
        return TASKS[name](**(params or {}))
    except TypeError as e:
        raise UnknownTask(f"bad parameters for task {name!r}: {e}") from None
