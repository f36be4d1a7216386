"""Task names resolve to built-ins, entry points or dotted paths, and only ever to Task classes."""

import pytest

from tasks import TaskError, make_task
from tasks.registry import task_class
from tests.support.envs import LetterE, MoreE


def test_dotted_path_loads_a_user_environment():
    task = make_task("tests.support.envs:MoreE", {"max_turns": 2})
    assert isinstance(task, MoreE) and task.max_turns == 2
    episode = task.episode(3)
    assert episode.messages == (("user", "Write letters e. Round 1 of game 3."),)
    step = episode.step("eee")
    assert step.done and episode.score() == pytest.approx(3 / 4)


def test_entry_point_names_a_user_environment(tmp_path, monkeypatch):
    # A real installed distribution's metadata, as `pip install` of a plugin package writes it.
    dist = tmp_path / "echo_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[echo_swarm.tasks]\nletters = tests.support.envs:LetterE\n"
                                           "broken = tests.support.envs:Missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert task_class("letters") is LetterE
    with pytest.raises(TaskError, match="cannot load task 'broken'"):
        make_task("broken")


@pytest.mark.parametrize("name, match", [
    ("chess", "unknown task 'chess'; built-in tasks: arithmetic, "),
    ("no_such_module_xyz:Task", "cannot load task"),
    ("tests.support.envs:Nope", "cannot load task"),
    ("os:system", "not a subclass of tasks.Task"),  # a name can never call arbitrary code
    ("tests.support.envs:e_share", "not a subclass of tasks.Task"),
])
def test_bad_names_are_refused_clearly(name, match):
    with pytest.raises(TaskError, match=match):
        make_task(name)


def test_bad_parameters_are_refused_clearly():
    assert make_task("arithmetic", {"digits": 2}).generate(3).seed == 3
    with pytest.raises(TaskError, match="bad parameters for task 'arithmetic'"):
        make_task("arithmetic", {"level": 3})
    with pytest.raises(TaskError, match="digits must be 1..6"):
        make_task("arithmetic", {"digits": 0})
    # Parameters no episode can satisfy fail at start, not in every lease of the run.
    with pytest.raises(TaskError, match="bad parameters for task 'sokoban'.*lower min_solution"):
        make_task("sokoban", {"size": 5, "boxes": 1, "min_solution": 12, "max_turns": 2})
