"""The "math" task: multi-step word problems, arithmetic, or a user's question/answer dataset.

- `word_problems`  seeded stories of 2-4 exact integer steps, the answer computed step by step
- `loaders`        question/answer rows from a JSONL file or a local Hugging Face dataset
- `task`           `MathTask`: picks the source, grades with `tasks.answers`

Answers are read by `tasks.answers.extract_answer`, shared with the arithmetic task.
"""

from tasks.maths.task import MathTask

__all__ = ["MathTask"]
