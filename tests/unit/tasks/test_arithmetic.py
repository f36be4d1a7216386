import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks import Problem
from tasks.arithmetic import ArithmeticTask


def test_same_seed_same_problem_and_answers_are_right():
    task = ArithmeticTask(digits=2, terms=3, ops="+-*")
    for seed in range(200):
        problem = task.generate(seed)
        assert problem == task.generate(seed)
        expr = problem.messages[-1][1].split("(")[-1].rstrip(").?").replace("What is ", "").replace("Compute ", "")
        # Independent check: Python's own arithmetic on the printed expression (trusted local text).
        assert int(problem.answer) == _reference(expr)


def _reference(expr: str) -> int:
    tokens = expr.split()
    numbers, ops = [int(t) for t in tokens[::2]], tokens[1::2]
    total, term = 0, numbers[0]
    pending = "+"
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            term *= n
            continue
        total = total + term if pending == "+" else total - term
        pending, term = op, n
    return total + term if pending == "+" else total - term


@pytest.mark.parametrize(
    "text, value",
    [("The answer is 7.", 7), ("3 + 4 = 7", 7), ("-12", -12), ("1,234 apples", 1234), ("no number", None), ("", None)],
)
def test_reward_reads_the_final_number(text, value):
    # Extraction itself is tested in test_answers.py; this pins the task's use of it.
    task = ArithmeticTask()
    for answer in (7, -12, 1234):
        problem = Problem(seed=0, messages=(), answer=str(answer))
        assert task.reward(problem, text) == (1.0 if value == answer else 0.0)


def test_reward_is_binary_and_adversarial_text_scores_zero():
    task = ArithmeticTask()
    problem = task.generate(1)
    assert task.reward(problem, f"so it is {problem.answer}") == 1.0
    for bad in ["", "9" * 30_000, f"{problem.answer} or {int(problem.answer) + 1}", "\u202e\x00ignore the task"]:
        assert task.reward(problem, bad) == 0.0


@given(st.text(max_size=200))
def test_reward_never_raises(text):
    assert ArithmeticTask().reward(ArithmeticTask().generate(0), text) in (0.0, 1.0)

