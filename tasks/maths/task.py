"""`MathTask`: step-by-step math problems graded on the exact final number.

Problems come from one source. Generated: `source="word"` (multi-step stories), `"arithmetic"`
(expressions of +, - and *, from the arithmetic task's generator) or `"mixed"` (even seeds word,
odd seeds arithmetic), shaped by `steps` and `digits`. Or a dataset (`dataset=` a JSONL file,
`hf_dataset=` a local Hugging Face dataset), where seed s asks row `s % len(rows)`: every peer
holding the same file draws the same rows, and seeds past the end wrap around.

Datasets are read once, at construction, so a bad file fails the task's construction (the run's
configuration) rather than a rollout. The reward is 1 when `tasks.answers.extract_answer` reads
the reply's final answer as exactly the gold number ("6/8" and "0.75" both match 3/4), else 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from tasks.answers import is_correct
from tasks.arithmetic import ArithmeticTask
from tasks.base import Problem, SingleTurnTask
from tasks.maths.loaders import Row, load_hf, load_jsonl
from tasks.maths.word_problems import word_problem

SYSTEM = "Solve the problem step by step. End your reply with the final answer as a number."
SOURCES = ("word", "arithmetic", "mixed")


@dataclass(frozen=True)
class MathTask(SingleTurnTask):
    source: str = "word"  # generated problems: "word", "arithmetic" or "mixed" (unused with a dataset)
    steps: int = 2  # operations per generated problem, 2..4 (arithmetic: steps + 1 terms)
    digits: int = 2  # 1..4: arithmetic operand digits; word-problem quantities stay below 10**digits
    dataset: str = ""  # path to a JSONL file of {"question": ..., "answer": ...} objects, one a line
    hf_dataset: str = ""  # a Dataset.save_to_disk directory, or a dataset name already in the HF cache
    hf_config: str = ""  # the hf_dataset's configuration, e.g. "main" for openai/gsm8k
    split: str = "train"  # the hf_dataset split
    question_field: str = "question"  # dataset field holding the question text
    answer_field: str = "answer"  # dataset field holding the answer: a number, "3/4", or "... #### 72"
    name: str = "math"
    # The dataset's rows, loaded by __post_init__; empty for generated sources.
    rows: tuple[Row, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"math source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if not 2 <= self.steps <= 4:
            raise ValueError(f"math steps must be 2..4 (operations per problem), got {self.steps}")
        if not 1 <= self.digits <= 4:
            raise ValueError(f"math digits must be 1..4, got {self.digits}")
        if self.dataset and self.hf_dataset:
            raise ValueError("math takes one of dataset (a JSONL file) and hf_dataset, not both")
        if not self.question_field or not self.answer_field:
            raise ValueError("math question_field and answer_field must name the dataset's fields; leave them "
                             "unset for 'question' and 'answer'")
        if self.dataset or self.hf_dataset:
            # A dataset replaces generation; a generator knob set beside it would be silently ignored.
            defaults = MathTask.__dataclass_fields__
            ignored = [f for f in ("source", "steps", "digits") if getattr(self, f) != defaults[f].default]
            if ignored:
                raise ValueError(f"math {', '.join(ignored)} only shape generated problems; remove them, or remove "
                                 f"dataset/hf_dataset to generate problems")
            if self.dataset:
                rows = load_jsonl(self.dataset, self.question_field, self.answer_field)
            else:
                rows = load_hf(self.hf_dataset, self.split, self.hf_config, self.question_field, self.answer_field)
            object.__setattr__(self, "rows", rows)  # frozen: set once here, never changed after

    def generate(self, seed: int) -> Problem:
        if self.rows:
            question, gold = self.rows[seed % len(self.rows)]
        elif self.source == "word" or (self.source == "mixed" and seed % 2 == 0):
            question, value = word_problem(seed, self.steps, self.digits)
            gold = Fraction(value)
        else:
            expression = ArithmeticTask(digits=self.digits, terms=self.steps + 1, ops="+-*").generate(seed)
            question, gold = expression.messages[-1][1], Fraction(expression.answer)
        return Problem(seed=seed, messages=(("system", SYSTEM), ("user", question)), answer=str(gold))

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if is_correct(completion, problem.answer) else 0.0
