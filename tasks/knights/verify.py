"""Grading a free-text knights-and-knaves answer: 1.0 for a clear, complete, correct assignment.

The reply is read in four steps, all regex and all capped (over MAX_REPLY_CHARS characters scores 0):

1. Normalise: NFKC, drop invisible format characters (zero-width, bidi controls), drop markdown
   emphasis (`*`, `_`, `` ` ``, `#`) so "**Alice** is a knave" reads as plain text.
2. Blank out reported speech: "says/said/claims/statement/told/..." up to the end of its clause (or
   its closing quote), so restating a puzzle statement ("Bob says Alice is a knave") is no claim.
3. Find assignments, sentence by sentence (split on . ! ? ; and newlines):
   - role first, where a subject starts: "Knights: Alice, Carol", "so the knaves are Bob and Dan";
   - names first: "Alice is a knight", "Alice and Carol are knights", "Alice: knave", "Alice - knight",
     "alice=knight", "| Alice | Knight |", "Bob is not a knight" (negation flips), "neither Alice
     nor Bob is a knave"; roles chained by "or", "/", "nor", ", not" all bind ("Alice is a knight
     or a knave" gives Alice both roles). Role words: knight(s), knave(s), truth-teller(s), liar(s).
   Skipped: questions, and any assignment preceded in its sentence by a hypothetical word (if,
   suppose, assume, would, case, ...), so "If Alice is a knight, then Bob is a knave" claims nothing.
4. Choose the answer region: the shortest suffix of the reply that starts right after a conclusion
   marker (<answer>, answer, final, solution, result, conclusion, summary, therefore, thus, hence,
   so, ...) or at the reply's start and that assigns every person. So a final summary wins over the reasoning before
   it, while text after the summary still counts ("... or maybe Alice is a knave" adds a conflict).

Score 1 only when, in that region, every person has exactly one role and it matches the solution.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

from tasks.base import MAX_REPLY_CHARS  # longer replies score 0

MAX_LIST = 8  # names in one list ("Alice, Bob and Carol are knights"); a puzzle has at most 8
MAX_GAP = 60  # characters allowed between a name list and its role word ("Alice is, in fact, a knight")

_ROLE = r"\b(?:knights?|knaves?|truth[- ]?tellers?|liars?)\b"
# A negation counts only right before the role ("is not a knave", "cannot really be a knight"), so a
# negation in an earlier clause ("Alice is not lying, so she is a knight") flips nothing.
_NEGATED = re.compile(
    r"(?:\b(?:not|never|cannot|neither|nor)\b|n't\b)(?:\s+[\w-]+){0,2}?\s*(?:\b(?:an?|the)\s+)?$",
    re.I,
)
_HYPOTHETICAL = re.compile(
    r"\b(?:if|suppose[sd]?|supposing|assum(?:e[sd]?|ing|ption)|hypothetical(?:ly)?|would"
    r"|case|cases|scenario|possibility|option|whether|unless)\b",
    re.I,
)
_REPORT = re.compile(
    r"\b(?:say|says|said|saying|claim(?:s|ed|ing)?|states?|stated|statements?|assert(?:s|ed)?"
    r"|accuse[sd]?|declare[sd]?|tells?|told)\b"
    r"[^\S\n]*(?:that\b)?[^\S\n]*:?[^\S\n]*(?:\"[^\"\n]*\"?|“[^”\n]*”?|[^,;.!?\n\"“]*)",
    re.I,
)
_COPULA = r"(?:\b(?:is|are|was|were|be|being|been|remains?|stays?)\b|[:=(|\-–—→>])"
_MARKER = re.compile(
    r"<answer>|\b(?:answers?|final|finally|solution|result|verdict|overall|conclusions?|conclude|summary"
    r"|summari[sz]e|summari[sz]ing|therefore|thus|hence|consequently|so)\b",
    re.I,
)
_SENTENCE = re.compile(r"[^.!?;\n]+[.!?;\n]?")
_MARKDOWN = re.compile(r"[*_`#]")


def grade(completion: str, answer: str) -> float:
    """1.0 if `completion` states exactly the assignment `answer` ("Alice=knight,Bob=knave")."""
    try:
        truth = dict(part.split("=") for part in answer.split(","))
    except ValueError:
        return 0.0
    if not isinstance(completion, str) or len(completion) > MAX_REPLY_CHARS:
        return 0.0
    stated = read_assignment(completion, tuple(truth))
    return 1.0 if stated == {name: {truth[name] == "knight"} for name in truth} else 0.0


def read_assignment(text: str, names: tuple[str, ...]) -> dict[str, set[bool]] | None:
    """Name -> roles stated (True = knight) in the answer region, or None when even the whole reply
    leaves someone out. A name with two roles is a contradiction the caller scores 0."""
    text = _normalise(text[:MAX_REPLY_CHARS])[:MAX_REPLY_CHARS]  # NFKC can lengthen text
    found = sorted(_assignments(text, names))  # (position, name, knight)
    boundaries = sorted({m.end() for m in _MARKER.finditer(text)} | {0}, reverse=True)
    roles: dict[str, set[bool]] = {}
    i = len(found)
    for start in boundaries:  # grow the suffix back one marker at a time
        while i > 0 and found[i - 1][0] >= start:
            i -= 1
            _, name, knight = found[i]
            roles.setdefault(name, set()).add(knight)
        if len(roles) == len(names):
            return roles
    return None


def _normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return _MARKDOWN.sub("", text)


@lru_cache(maxsize=256)
def _patterns(names: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """(role-first, names-first, name) patterns for one puzzle's names, case-insensitive."""
    name = r"\b(?:" + "|".join(re.escape(n) for n in names) + r")\b"
    # At most MAX_LIST names, and separators with one parse each: bounded backtracking on any text.
    separator = r"(?:\s*,\s*(?:and\s+)?|\s+and\s+|\s*[&/]\s*|\s+nor\s+)"
    name_list = rf"{name}(?:{separator}{name}){{0,{MAX_LIST - 1}}}"
    # Between names and role there must be a copula or a separator ("is", "are ... be", ":", "=",
    # "-", "(", "|", "->"): "Tom has no knights" or "Bob likes knaves" assign nothing.
    free = rf"(?:(?!{name}|{_ROLE})[^.!?;\n])"
    gap = rf"(?={free}{{0,{MAX_GAP}}}?{_COPULA}){free}{{0,{MAX_GAP}}}?"
    # A role chained to the previous one for the same names: "a knight or a knave", "knight/knave",
    # "knights and knaves", "a knight, not a knave", "a knight, who is also a knave". A comma before
    # "and" does not chain: "Bob is a knave, and knights ...".
    chain = (r"(?:\s*/\s*|,?\s*\b(?:or|nor)\b\s*|\s+and\s+|,?\s*(?:\b(?:and|but)\s+)?(?=not\b)"
             r"|,?\s*\b(?:who|which|that)\s+(?:is|are|was|were)\s+(?:also\s+)?)(?:not\s+)?(?:an?\s+|the\s+)?")
    role_first = re.compile(
        # Only where a subject starts ("So the knights are ..."), never after "a"/"is" ("is a knight: ...").
        r"(?:^|(?<=[,(:])|\b(?:and|while|whereas|but|so|thus|therefore|hence|then)\b)[\s\-–—•>)]*"
        r"(?:the\s+|all\s+)?(?:only\s+)?(?:(?:two|three|four|five|six|seven|eight|\d)\s+)?"
        rf"(?P<role>{_ROLE})\s*(?:\b(?:are|is|were|was|include[sd]?)\b|[:=]|->|→)\s*"
        # The list stops before a name that heads its own claim: "..., and Bob is a knave".
        rf"(?P<names>{name_list})(?![^\S\n]*(?:\b(?:is|are|was|were|must|can|cannot|isn't|aren't)\b|[:=(\-–—→]))",
        re.I,
    )
    names_first = re.compile(
        rf"(?P<neither>\bneither\s+)?(?P<names>(?>{name_list}))(?P<gap>{gap})(?P<roles>{_ROLE}(?:{chain}{_ROLE})*)",
        re.I,
    )
    return role_first, names_first, re.compile(name, re.I)


def _assignments(text: str, names: tuple[str, ...]):
    """Yield (position, name, knight) for every non-hypothetical claim in `text`."""
    role_first, names_first, name_re = _patterns(names)
    canonical = {n.lower(): n for n in names}
    text = _REPORT.sub(lambda m: " " * len(m.group()), text)  # blanks keep positions
    for sentence in _SENTENCE.finditer(text):
        body = sentence.group()
        if body.rstrip().endswith("?"):
            continue
        hypothetical = _HYPOTHETICAL.search(body)
        cut = hypothetical.start() if hypothetical else len(body)  # claims must end before it
        found: list[tuple[re.Match, bool]] = []
        for m in role_first.finditer(body):
            found.append((m, _is_knight(m.group("role"))))
        rest = role_first.sub(lambda m: " " * len(m.group()), body)
        for m in names_first.finditer(rest):
            # The first role takes the negation between names and role; a chained one that of its
            # own link ("a knight, not a knave"; "neither a knight nor a knave").
            negated = bool(_NEGATED.search(m.group("gap"))) != bool(m.group("neither"))
            link_start = 0
            for role in re.finditer(_ROLE, m.group("roles"), re.I):
                if link_start:
                    negated = bool(_NEGATED.search(m.group("roles")[link_start : role.start()]))
                found.append((m, _is_knight(role.group()) != negated))
                link_start = role.end()
        for m, knight in found:
            if m.end() <= cut:
                for n in name_re.finditer(m.group("names")):
                    position = sentence.start() + m.start("names") + n.start()
                    yield position, canonical[n.group().lower()], knight


def _is_knight(role: str) -> bool:
    role = role.lower()
    return role.startswith("knight") or role.startswith("truth")
