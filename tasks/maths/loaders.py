"""Question/answer rows for `MathTask` from a user's JSONL file or a local Hugging Face dataset.

A row is (question, gold) with gold an exact Fraction. Answers are read by the same extractor that
grades replies, so 72, "72", "3/4", 0.5 and a GSM8K solution ending in "#### 72" all work. Every
problem is reported as a ValueError naming the file (or dataset) and line (or row) and saying
how to fix it, so a bad file fails at task construction, never mid-run.

Hugging Face datasets are only ever read locally: a directory written by `save_to_disk`, or a
name already in the local HF cache, loaded with the hub switched to offline mode. A machine that
lacks the data fails with a clear error instead of downloading on every peer.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any

from tasks.answers import extract_answer, parse_number

Row = tuple[str, Fraction]  # (question, gold answer)
ANSWER_HELP = "give a number, a fraction like \"3/4\", or a solution ending in \"#### 72\""


def load_jsonl(path: str, question_field: str, answer_field: str) -> tuple[Row, ...]:
    """One JSON object per line; blank lines are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"math dataset {path}: cannot read it as UTF-8 text ({e})") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"math dataset {path} line {number}"
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:  # also ints too long for int(), deep nesting
            raise ValueError(f"{where}: not valid JSON ({e}); write one JSON object per line") from None
        rows.append(to_row(record, question_field, answer_field, where))
    if not rows:
        raise ValueError(f"math dataset {path} has no rows; write one JSON object per line, "
                         f"like {{\"{question_field}\": \"What is 2 + 3?\", \"{answer_field}\": \"5\"}}")
    return tuple(rows)


def load_hf(name: str, split: str, config: str, question_field: str, answer_field: str) -> tuple[Row, ...]:
    """A `save_to_disk` directory, or a dataset name already in the local Hugging Face cache."""
    try:
        import datasets  # optional and slow to import: only math tasks with hf_dataset need it
    except ImportError:
        raise ValueError("math hf_dataset needs the `datasets` package; install it (pip install datasets), "
                         "or export the rows to JSONL and pass dataset=PATH") from None
    where = f"math hf_dataset {name!r}"
    try:
        if os.path.isdir(name):
            loaded = datasets.load_from_disk(name)
        else:
            with _hub_offline(datasets):
                loaded = datasets.load_dataset(name, config or None, split=split)
    except (OSError, ValueError) as e:  # ConnectionError and DatasetNotFoundError are OSErrors
        raise ValueError(f"{where}: cannot load it locally ({type(e).__name__}: {e}); nothing is downloaded, "
                         f"so pass a directory written by Dataset.save_to_disk, or a name already in the HF cache"
                         ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{where} has no split {split!r}; set split to one of {sorted(loaded)}")
        loaded = loaded[split]
    missing = [f for f in (question_field, answer_field) if f not in loaded.column_names]
    if missing:
        raise ValueError(f"{where} has no column {missing[0]!r}; its columns are {loaded.column_names}: "
                         f"set question_field and answer_field")
    if len(loaded) == 0:
        raise ValueError(f"{where} split {split!r} has no rows")
    pairs = zip(loaded[question_field], loaded[answer_field])
    return tuple(to_row({question_field: q, answer_field: a}, question_field, answer_field, f"{where} row {i}")
                 for i, (q, a) in enumerate(pairs))


def to_row(record: Any, question_field: str, answer_field: str, where: str) -> Row:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with {question_field!r} and {answer_field!r}, "
                         f"got {type(record).__name__}")
    for field in (question_field, answer_field):
        if field not in record:
            raise ValueError(f"{where}: missing field {field!r} (fields present: {sorted(record)}); "
                             f"add it or set question_field/answer_field")
    question = record[question_field]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: {question_field!r} must be non-empty text, got {question!r:.80}")
    gold = gold_value(record[answer_field])
    # Problem.answer carries str(gold), which the verifier re-reads: it must survive the round trip.
    if gold is None or parse_number(str(gold)) != gold:
        raise ValueError(f"{where}: cannot read a number from {answer_field!r} {record[answer_field]!r:.80}; "
                         f"{ANSWER_HELP}")
    return question, gold


def gold_value(answer: Any) -> Fraction | None:
    """A dataset's answer as an exact number: JSON numbers as written, text as a reply would be read."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer) if answer.bit_length() <= 300 else None  # ~90 digits; str() of huge ints raises
    if isinstance(answer, float):
        return Fraction(repr(answer)) if math.isfinite(answer) else None  # 0.1 -> 1/10, not the binary double
    if isinstance(answer, str):
        return extract_answer(answer)
    return None


@contextmanager
def _hub_offline(datasets: Any) -> Iterator[None]:
    """Offline mode for one load. Both libraries read the flag from module globals set at import,
    so the environment variables would come too late; restored after, so other code (a node
    fetching its model) keeps its network."""
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved
