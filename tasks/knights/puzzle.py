"""Knights-and-knaves puzzles: the statement grammar, its English, a solver and the generator.

Knights always tell the truth and knaves always lie, so a statement is consistent with its speaker
exactly when (speaker is a knight) == (statement is true). A puzzle gives every person one statement
and is kept only when exactly one knight/knave assignment is consistent with all of them.

An assignment is an int mask over the people, bit i set = person i is a knight. The solver works on
truth tables: a statement's table is a 2**n-bit int whose bit m says whether it holds under
assignment m, so `and`/`or`/`if` are single int operations (n <= 8: 256-bit ints).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

# Common first names that are not English words or role words, so the verifier can find them.
NAMES = (
    "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Henry", "Isabel", "Kevin", "Laura",
    "Mia", "Noah", "Olivia", "Peter", "Quinn", "Ruby", "Sam", "Tom", "Uma", "Victor",
    "Wendy", "Xavier", "Yara", "Zoe", "Oscar", "Nina", "Leo", "Hugo", "Ivy", "Greta",
)  # fmt: skip
MAX_PEOPLE = 8  # the solver enumerates 2**people assignments
MAX_ROUNDS = 400  # statement replacements before restarting from a fresh hidden assignment
OPS = ("is", "is", "and", "or", "if", "iff", "xor")  # "is" twice: plain claims are the classic core


@dataclass(frozen=True)
class Is:
    """Atom: person `who` is a knight (`knight=True`) or a knave."""

    who: int
    knight: bool


@dataclass(frozen=True)
class Join:
    """Two atoms about different people joined by `op`: "and", "or" (at least one), "if" (left
    implies right), "iff" or "xor". The generator draws `iff` as (knight, any) and `xor` with equal
    roles, the shapes that read naturally as "same/different kinds" and "exactly one of"."""

    op: str
    left: Is
    right: Is


Statement = Is | Join


@dataclass(frozen=True)
class Puzzle:
    names: tuple[str, ...]
    statements: tuple[Statement, ...]  # statements[i] is said by names[i]
    knights: tuple[bool, ...]  # the unique consistent assignment


# --- solver ---------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _knight_tables(n: int) -> tuple[int, ...]:
    """Per person i, the truth table of "i is a knight": bit m set iff bit i of m is set."""
    return tuple(sum(1 << m for m in range(1 << n) if m >> i & 1) for i in range(n))


def truth_table(statement: Statement, n: int) -> int:
    full = (1 << (1 << n)) - 1
    if isinstance(statement, Is):
        table = _knight_tables(n)[statement.who]
        return table if statement.knight else full & ~table
    a, b = truth_table(statement.left, n), truth_table(statement.right, n)
    if statement.op == "and":
        return a & b
    if statement.op == "or":
        return a | b
    if statement.op == "if":
        return (full & ~a) | b
    if statement.op == "iff":
        return full & ~(a ^ b)
    if statement.op == "xor":
        return a ^ b
    raise ValueError(f"unknown statement op {statement.op!r}")


def consistent(speaker: int, statement: Statement, n: int) -> int:
    """Truth table of "the speaker's role matches the statement's truth"."""
    full = (1 << (1 << n)) - 1
    return full & ~(_knight_tables(n)[speaker] ^ truth_table(statement, n))


def solutions(statements: tuple[Statement, ...] | list[Statement]) -> list[int]:
    """Every assignment mask consistent with all statements (statement i said by person i)."""
    n = len(statements)
    table = (1 << (1 << n)) - 1
    for speaker, statement in enumerate(statements):
        table &= consistent(speaker, statement, n)
    return [m for m in range(1 << n) if table >> m & 1]


# --- generator ------------------------------------------------------------------------------------


def make_puzzle(rng: random.Random, n: int) -> Puzzle:
    """Hide an assignment, give each person a statement true iff they are a knight (so the hidden
    assignment always stays consistent), then replace statements at random, keeping any change that
    does not add solutions, until the hidden assignment is the only one left."""
    if not 2 <= n <= MAX_PEOPLE:
        raise ValueError(f"a puzzle needs 2..{MAX_PEOPLE} people, got {n}")
    names = tuple(rng.sample(NAMES, n))
    while True:  # a dead end (no improving replacement for MAX_ROUNDS) restarts; rare
        hidden = rng.getrandbits(n)
        statements = [_draw(rng, p, n, hidden) for p in range(n)]
        tables = [consistent(p, s, n) for p, s in enumerate(statements)]
        for _ in range(MAX_ROUNDS):
            count = _and_all(tables).bit_count()
            if count == 1:
                knights = tuple(bool(hidden >> i & 1) for i in range(n))
                return Puzzle(names, tuple(statements), knights)
            p = rng.randrange(n)
            candidate = _draw(rng, p, n, hidden)
            trial = tables[:p] + [consistent(p, candidate, n)] + tables[p + 1 :]
            if _and_all(trial).bit_count() <= count:
                statements[p], tables = candidate, trial


def _and_all(tables: list[int]) -> int:
    out = tables[0]
    for t in tables[1:]:
        out &= t
    return out


def _draw(rng: random.Random, speaker: int, n: int, hidden: int) -> Statement:
    """A random statement for `speaker` that is true iff the speaker is a knight under `hidden`
    and that tells something (not satisfied by every assignment, like "I am a knight")."""
    full = (1 << (1 << n)) - 1
    others = [i for i in range(n) if i != speaker]
    while True:
        op = rng.choice(OPS)
        if op == "is":
            statement: Statement = Is(rng.choice(others), rng.random() < 0.5)
        else:
            x, y = rng.sample(range(n), 2)  # may include the speaker: "Bob and I are ..."
            if op == "iff":
                roles = (True, rng.random() < 0.5)
            elif op == "xor":
                roles = (rng.random() < 0.5,) * 2
            else:
                roles = (rng.random() < 0.5, rng.random() < 0.5)
            statement = Join(op, Is(x, roles[0]), Is(y, roles[1]))
        table = consistent(speaker, statement, n)
        if table >> hidden & 1 and table != full:
            return statement


# --- English --------------------------------------------------------------------------------------


def render(statement: Statement, speaker: int, names: tuple[str, ...]) -> str:
    """The statement as the speaker says it, first person for themselves: "Bob and I are ..."."""

    def subject(i: int) -> str:
        return "I" if i == speaker else names[i]

    def atom(a: Is) -> str:
        return f"{subject(a.who)} {'am' if a.who == speaker else 'is'} a {_role(a.knight)}"

    if isinstance(statement, Is):
        return _sentence(atom(statement))
    op, left, right = statement.op, statement.left, statement.right
    if op == "if":
        return _sentence(f"if {atom(left)}, then {atom(right)}")
    first, second = (right, left) if left.who == speaker else (left, right)  # "Bob and I", not "I and Bob"
    pair = f"{subject(first.who)} and {subject(second.who)}"
    same = left.knight == right.knight
    if op == "and":
        return _sentence(f"{pair} are both {_role(left.knight)}s" if same else f"{atom(left)} and {atom(right)}")
    if op == "or":
        if same:
            return _sentence(f"at least one of {pair} is a {_role(left.knight)}")
        return _sentence(f"{atom(left)} or {atom(right)}, or both")
    if op == "iff":
        return _sentence(f"{pair} are of {'the same kind' if same else 'different kinds'}")
    if op == "xor" and same:
        return _sentence(f"exactly one of {pair} is a {_role(left.knight)}")
    raise ValueError(f"cannot render {statement!r}")


def _role(knight: bool) -> str:
    return "knight" if knight else "knave"


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."
