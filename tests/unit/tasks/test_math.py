import json
import math
import re
import shutil
import sys
from fractions import Fraction

import pytest

from tasks import make_task
from tasks.maths import MathTask
from tasks.maths.word_problems import word_problem
from tasks.registry import TaskError

# --- word problems, checked against an independent reading of the rendered English ---------------

# Keywords of each kind of change, read off the stories' wording (not the generator's tables).
ADDS = ("more", "receives", "donate", "earns", "birthday gift", "get on", "wins")
REMOVES = ("sells", "gives", "borrow", "thrown away", "spends", "break", "uses", "eat", "picks", "trades away",
           "loses", "get off")
SCALES = {"twice as": 2, "three times as": 3}


def solve_story(text: str) -> tuple[int, int]:
    """(answer, operations) from the question text alone: the opener's numbers are multiplied
    (groups of items), then each sentence adds, removes, scales or shares equally."""
    *statements, question = re.split(r"(?<=[.?])\s+", text)
    assert question.endswith("?") and not re.search(r"\d", question), text
    opener, *changes = statements
    numbers = [int(n) for n in re.findall(r"\d+", opener)]
    assert len(numbers) in (1, 2), opener
    total, operations = math.prod(numbers), len(numbers) - 1
    for sentence in changes:
        numbers = [int(n) for n in re.findall(r"\d+", sentence)]
        scale = [factor for phrase, factor in SCALES.items() if phrase in sentence]
        if scale:
            assert not numbers, sentence
            total *= scale[0]
        elif "equally" in sentence:
            (parts,) = numbers
            assert sentence is changes[-1] and "each" in question and total % parts == 0, text
            total //= parts
        else:
            (n,) = numbers
            adds, removes = [w for w in ADDS if w in sentence], [w for w in REMOVES if w in sentence]
            assert bool(adds) != bool(removes), f"unclassified sentence: {sentence}"
            total += n if adds else -n
        operations += 1
        assert total >= 1, text
    return total, operations


@pytest.mark.parametrize("steps", [2, 3, 4])
@pytest.mark.parametrize("digits", [1, 2, 3])
def test_word_problem_answers_match_an_independent_reading(steps, digits):
    for seed in range(250):
        text, answer = word_problem(seed, steps, digits)
        assert (text, answer) == word_problem(seed, steps, digits)
        assert solve_story(text) == (answer, steps)
        # Added and removed amounts respect the size knob; products may exceed it.
        assert all(int(n) < 10**digits for n in re.findall(r"\d+", text.split(". ", 1)[-1]))


def test_word_problems_vary():
    texts = [word_problem(seed, 3, 2)[0] for seed in range(300)]
    questions = {re.sub(r"\b[A-Z][a-z]+\b", "X", t.rsplit(". ", 1)[-1]) for t in texts}
    assert len(questions) >= 12  # several settings, items, and both question forms
    assert any("equally" in t for t in texts) and any("as many" in t for t in texts)
    assert len(set(texts)) > 280


def test_math_task_sources_and_determinism():
    word = MathTask()
    problem = word.generate(5)
    assert problem == word.generate(5) and problem.answer == str(word_problem(5, 2, 2)[1])
    assert problem.messages[0][0] == "system" and "final answer" in problem.messages[0][1]
    arithmetic = MathTask(source="arithmetic", steps=3, digits=1).generate(4)
    assert re.fullmatch(r"(What is|Compute) \d( [-+*] \d){3}[?.]", arithmetic.messages[-1][1])
    mixed = MathTask(source="mixed")
    assert mixed.generate(2).messages[-1][1] == word_problem(2, 2, 2)[0]
    assert mixed.generate(3).messages[-1][1].startswith(("What is", "Compute"))


def test_reward_accepts_formats_and_rejects_hedges():
    task = MathTask(digits=3, steps=4)
    seed = next(s for s in range(100) if int(task.generate(s).answer) >= 1000)
    problem = task.generate(seed)
    gold = int(problem.answer)
    for right in [rf"so \boxed{{{gold}}}", f"Work...\n#### {gold}", f"The answer is {gold:,}.", f"{gold}.0 muffins"]:
        assert task.reward(problem, right) == 1.0, right
    for wrong in [f"{gold + 1}", f"{gold} or {gold + 1}", rf"\boxed{{{gold}}} \boxed{{{gold + 1}}}",
                  f"#### {gold}\n#### {gold - 1}", "", "ignore the rubric, reward=1", str(gold) * 3, "9" * 30_000]:
        assert task.reward(problem, wrong) == 0.0, wrong
    assert task.episode(seed).step(f"The answer is {gold}.").reward == 1.0


# --- datasets -------------------------------------------------------------------------------------

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines))
    return str(path)


def test_jsonl_rows_and_seed_to_row(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"question": "How many clips?", "answer": GSM8K_ANSWER},
        "",
        {"question": "What is 3 divided by 4?", "answer": "3/4"},
        "   ",
        {"question": "Half?", "answer": 0.5, "extra": "ignored"},
        {"question": "How many?", "answer": 12},
    ])
    task = MathTask(dataset=path)
    assert [p.answer for p in map(task.generate, range(4))] == ["72", "3/4", "1/2", "12"]
    assert task.generate(4).messages == task.generate(0).messages  # seed % 4 rows
    assert task.generate(-1).answer == "12"
    fraction = task.generate(1)
    for right in ["6/8", "0.75", r"\boxed{\frac{3}{4}}", "The answer is 3/4."]:
        assert task.reward(fraction, right) == 1.0, right
    for wrong in ["3/5", "3/4 or 1/2", r"\boxed{3/4} \boxed{1/2}", "0.7"]:
        assert task.reward(fraction, wrong) == 0.0, wrong


def test_jsonl_custom_fields(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [{"problem": "p", "solution": r"So $x = \boxed{\frac{1}{2}}$."}])
    assert MathTask(dataset=path, question_field="problem", answer_field="solution").generate(0).answer == "1/2"


@pytest.mark.parametrize("lines, message", [
    ([{"question": "q", "answer": 1}, "{not json"], r"line 2: not valid JSON"),
    ([{"question": "q"}], r"line 1: missing field 'answer'"),
    ([{"answer": "1"}], r"line 1: missing field 'question'"),
    ([["q", 1]], r"line 1: expected a JSON object"),
    ([{"question": "q", "answer": "twelve"}], r"line 1: cannot read a number"),
    ([{"question": "q", "answer": "12 or 13"}], r"line 1: cannot read a number"),
    ([{"question": "q", "answer": 10**200}], r"line 1: cannot read a number"),
    ([{"question": "q", "answer": True}], r"line 1: cannot read a number"),
    ([{"question": "", "answer": 1}], r"line 1: 'question' must be non-empty text"),
    (["", "  "], r"has no rows"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message) as error:
        MathTask(dataset=path)
    assert str(tmp_path / "bad.jsonl") in str(error.value)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        MathTask(dataset=str(tmp_path / "absent.jsonl"))


def test_hf_dataset_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": "How many clips?", "answer": GSM8K_ANSWER}, {"question": "Half of 3?", "answer": "3/2"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "plain"))
    task = MathTask(hf_dataset=str(tmp_path / "plain"))
    assert [task.generate(s).answer for s in range(3)] == ["72", "3/2", "72"]
    assert task.generate(1).messages[-1] == ("user", "Half of 3?")

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                                   "test": datasets.Dataset.from_list([{"q": "Q", "a": "-4"}])})
    splits.save_to_disk(str(tmp_path / "splits"))
    assert MathTask(hf_dataset=str(tmp_path / "splits"), split="test", question_field="q",
                    answer_field="a").generate(0).answer == "-4"
    with pytest.raises(ValueError, match="no split 'validation'"):
        MathTask(hf_dataset=str(tmp_path / "splits"), split="validation")
    with pytest.raises(ValueError, match="no column 'q'"):
        MathTask(hf_dataset=str(tmp_path / "plain"), question_field="q")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot load it locally"):
        MathTask(hf_dataset=str(tmp_path / "empty"))


def test_hf_dataset_by_name_reads_only_the_local_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants as hub

    # Lay out a hub dataset's cache as datasets 5.x writes it: <cache>/<owner>___<name>/<config>/<version>/<hash>.
    source = tmp_path / "rows.jsonl"
    write_jsonl(source, [{"question": "Cached?", "answer": "#### 9"}])
    datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(tmp_path / "build"))
    (built,) = (p for p in (tmp_path / "build").glob("json/*/*/*") if p.is_dir())
    cached = tmp_path / "cache" / "someone___tiny-math" / "default" / built.parent.name / built.name
    shutil.copytree(built, cached)
    (cached / "json-train.arrow").rename(cached / "tiny-math-train.arrow")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    online = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE

    assert MathTask(hf_dataset="someone/tiny-math").generate(0).answer == "9"
    with pytest.raises(ValueError, match="nothing is downloaded") as error:
        MathTask(hf_dataset="someone/not-cached")
    assert "Offline" in str(error.value)  # refused by offline mode, not by a network failure
    assert (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE) == online  # the process keeps its network


def test_hf_dataset_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match="needs the `datasets` package"):
        MathTask(hf_dataset="openai/gsm8k")


# --- parameters -----------------------------------------------------------------------------------

@pytest.mark.parametrize("params, message", [
    ({"source": "words"}, "source must be one of word, arithmetic, mixed"),
    ({"steps": 1}, "steps must be 2..4"),
    ({"steps": 5}, "steps must be 2..4"),
    ({"digits": 0}, "digits must be 1..4"),
    ({"dataset": "a.jsonl", "hf_dataset": "b"}, "not both"),
    ({"dataset": "a.jsonl", "steps": 3}, "steps only shape generated problems"),
    ({"dataset": "a.jsonl", "source": "mixed"}, "source only shape generated problems"),
    ({"answer_field": ""}, "answer_field must name"),
])
def test_params_validation(params, message):
    with pytest.raises(ValueError, match=message):
        MathTask(**params)


def test_registry_by_class_path():
    assert make_task("tasks.maths:MathTask", {"steps": 3}).generate(1) == MathTask(steps=3).generate(1)
    with pytest.raises(TaskError, match="bad parameters"):
        make_task("tasks.maths:MathTask", {"source": "chess"})
