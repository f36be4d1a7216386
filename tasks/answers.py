r"""Reading a model's final answer as an exact number; the one extractor every math verifier uses.

Precedence: the strongest kind of answer marker present decides, and weaker kinds are ignored.
  1. `\boxed{...}` (braces balanced, so `\boxed{\frac{3}{4}}` works; `\fbox` too);
  2. GSM8K's `#### 72` (only when a number follows, so markdown headings like `#### Step 1` are text);
  3. an answer phrase: "answer is 72", "answer: 72", "final answer = 72" (any case);
  4. no marker: the last number in the text.
Hedges score nothing, since a reply that names two values must not be paid for either: a marker
used several times must agree (two boxes, `####`s or phrases with different values read as None,
the same value twice reads as it), the last box or `####` must hold exactly one number (`\boxed{12
or 13}`, `\boxed{x}`, an unclosed `\boxed{` read as None), and "12 or 13" in the phrase's sentence
or in the sentence holding the last number reads as None. Inside a box only what follows the last
"=" counts (`\boxed{x = 5}` is 5); `\text{...}` wrappers are unwrapped and units around the one
number are allowed (`\boxed{26 \text{ muffins}}`).

Numbers are exact Fractions: 72, -5, 1,234 (commas only in groups of three, so "1,2,3" is three
numbers), 3.5, 3/4 (no spaces around "/"), \frac{3}{4} (\dfrac, \tfrac), $12 (currency signs are
ignored) and 12% (read as 12: percent questions are graded in percent, as GSM8K does). A minus
right after a digit, letter or bracket is subtraction, not a sign ("5-3" is 5 then 3). Not read:
exponents, number words, non-ASCII digits, and numbers of over 100 digits (Python's int() refuses
very long strings). Texts over 20,000 characters read as None, and every pattern here is linear,
so a verifier never spends long on hostile input. Nothing here raises on any string.
"""

from __future__ import annotations

import re
from fractions import Fraction

from tasks.base import MAX_REPLY_CHARS  # longer replies read as None

MAX_DIGITS = 100

_NUMBER = re.compile(
    r"(?<![0-9./])"  # never the tail of a longer number, decimal, fraction or date
    r"(?:(?<![0-9A-Za-z)\]}])([-\u2212]))?"  # after a term a minus is subtraction, not a sign
    # "1,234"; "1,2,3" falls to plain runs. At most 33 groups (MAX_DIGITS): unbounded, every start
    # inside "1,000,...,000,0" rescanned the rest, quadratic in the reply's length.
    r"([0-9]{1,3}(?:,[0-9]{3}){1,33}(?![0-9]|,[0-9])|[0-9]+)"
    r"(?:\.([0-9]+))?"
    r"(?:/([0-9]+))?"
)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_HASHES = re.compile(r"####[ \t*$]*([-\u2212]?[0-9][^\n]*)")
_PHRASE = re.compile(r"answer\s{0,3}(?:is|was|:|=)[\s:=*$(\\]{0,12}", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\n|[.!?;](?=\s|$)")
_OR = re.compile(r"[\s,*$]*or[\s*$]+(?:(?:maybe|perhaps|possibly)[\s*$]+)?", re.IGNORECASE)
_LATEX_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LATEX_FRAC = re.compile(r"(?:([-\u2212])\s{0,3})?\\[dt]?frac\s*\{\s*([-\u2212]?[0-9]+)\s*\}\s*\{\s*([0-9]+)\s*\}")
_LATEX_NOISE = (("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\;", " "), ("\\ ", " "), ("\\$", "$"), ("\\%", "%"))


def extract_answer(text: str) -> Fraction | None:
    """The final answer a reply commits to (rules in the module docstring), or None."""
    if not isinstance(text, str) or len(text) > MAX_REPLY_CHARS:
        return None
    text = _normalize(text)
    for marked in (_boxed_values, _hash_values, _phrase_values):
        values = marked(text)
        if values:
            return _agreed(values)
    return _last_number(text)


def parse_number(text: str) -> Fraction | None:
    """The value of a short answer holding exactly one number ("72", "$1,234", "3/4", "\\frac{3}{4}",
    "26 muffins"); None when it holds none or several ("12 or 13", "x^2 = 4")."""
    if not isinstance(text, str) or len(text) > MAX_REPLY_CHARS:
        return None
    numbers = list(_NUMBER.finditer(_normalize(text)))
    return _value(numbers[0]) if len(numbers) == 1 else None


def is_correct(completion: str, gold: str) -> bool:
    """Whether the reply's final answer equals the gold answer (`Problem.answer`, e.g. "72" or
    "3/4") as exact numbers, so "6/8" and "0.75" match "3/4"."""
    expected = parse_number(gold)
    return expected is not None and extract_answer(completion) == expected


def _normalize(text: str) -> str:
    """LaTeX spellings of numbers as plain ones: `\\text{12}` -> 12, `-\\frac{3}{4}` -> -3/4."""
    text = _LATEX_WRAPPER.sub(r"\1", text)
    # A space in front keeps a mixed number "2\frac{1}{2}" from reading as 21/2.
    text = _LATEX_FRAC.sub(lambda m: f" {m[1] or ''}{m[2]}/{m[3]}", text)
    for latex, plain in _LATEX_NOISE:
        text = text.replace(latex, plain)
    return text


def _value(number: re.Match) -> Fraction | None:
    sign, whole, decimals, denominator = number.groups()
    whole, decimals = whole.replace(",", ""), decimals or ""
    if len(whole) + len(decimals) + len(denominator or "") > MAX_DIGITS:
        return None
    value = Fraction(int(whole + decimals), 10 ** len(decimals))
    if denominator:
        if int(denominator) == 0:
            return None
        value /= int(denominator)
    return -value if sign else value


def _agreed(values: list[Fraction | None]) -> Fraction | None:
    """The last marker's value, when no earlier marker names a different number."""
    last = values[-1]
    return last if last is not None and all(v is None or v == last for v in values) else None


def _boxed_values(text: str) -> list[Fraction | None]:
    values, pos = [], 0
    while box := _BOXED.search(text, pos):
        depth, end = 1, None
        for brace in _BRACE.finditer(text, box.end()):
            depth += 1 if brace[0] == "{" else -1
            if depth == 0:
                end = brace.start()
                break
        if end is None:  # unclosed: a cut-off or malformed answer, and nothing after it is boxed
            return values + [None]
        values.append(parse_number(text[box.end() : end].rsplit("=", 1)[-1]))
        pos = end + 1  # boxes nested inside this one are part of its content, not answers
    return values


def _hash_values(text: str) -> list[Fraction | None]:
    return [parse_number(m[1]) for m in _HASHES.finditer(text)]


def _phrase_values(text: str) -> list[Fraction | None]:
    values = []
    for phrase in _PHRASE.finditer(text):
        number = _NUMBER.match(text, phrase.end())
        if number is None:  # "the answer is the number of ..." names no answer
            continue
        stop = _SENTENCE_END.search(text, number.end(), number.end() + 150)
        sentence = text[number.start() : stop.start() if stop else number.end() + 150]
        values.append(None if _hedged(sentence) else _value(number))
    return values


def _last_number(text: str) -> Fraction | None:
    last = None
    for last in _NUMBER.finditer(text):
        pass
    if last is None:
        return None
    start = max(text.rfind(mark, 0, last.start()) for mark in ("\n", ". ", "! ", "? ", "; "))
    return None if _hedged(text[max(start, 0) :]) else _value(last)


def _hedged(sentence: str) -> bool:
    """Whether two different numbers are offered as alternatives: "12 or 13", "12, or maybe 13"."""
    if "or" not in sentence.lower():  # cheap exit: adversarial texts can hold thousands of sentences
        return False
    numbers = list(_NUMBER.finditer(sentence))
    for a, b in zip(numbers, numbers[1:]):
        between = sentence[a.end() : b.start()]
        if len(between) <= 30 and _OR.fullmatch(between) and a[0] != b[0] and _value(a) != _value(b):
            return True
    return False
