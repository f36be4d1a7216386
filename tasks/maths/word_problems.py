"""Multi-step word problems from a seed: short stories whose answer the generator tracks as it writes.

A story opens with a quantity, either counted ("Ava has 34 stickers.") or as groups, which is one
multiplication ("Ava buys 4 packs of 12 stickers."), then changes it one sentence at a time: add,
remove, scale ("twice as many") or, last, share equally ("How many ... each?"). `steps` counts the
operations, the opener's multiplication included. Each change is applied to the running integer
as it is written, so the answer never comes from evaluating text, and every draw keeps it a
positive integer: removals leave at least one, shares use an exact divisor, scaling happens once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Story:
    """How one setting words each kind of step. Placeholders: {name} {He} {he} {him} {item}, the
    numbers {a} {b} {n}, and {times} ("twice" or "three times")."""

    items: tuple[str, ...]  # plural nouns counted throughout; one is drawn per problem
    groups: str  # opener: {a} groups of {b}
    start: str  # opener: a plain count {a}
    add: tuple[str, ...]
    remove: tuple[str, ...]
    scale: str
    share: str  # split equally into {n} parts; always the last step
    ask_total: str
    ask_each: str  # the question after a share


STORIES = (
    Story(("muffins", "cookies", "bagels"), "{name} bakes {a} trays of {b} {item}.", "{name} bakes {a} {item}.",
          ("{He} bakes {n} more {item}.",), ("{He} sells {n} {item}.", "{He} gives {n} {item} to a neighbour."),
          "After a second batch {he} has {times} as many {item}.", "{He} packs the {item} equally into {n} boxes.",
          "How many {item} does {name} have now?", "How many {item} go in each box?"),
    Story(("books",), "A library has {a} shelves with {b} books on each shelf.", "A library has {a} books.",
          ("It receives {n} new books.", "Families donate {n} books."),
          ("Readers borrow {n} books.", "{n} damaged books are thrown away."),
          "After a big donation it has {times} as many books.", "The books are shared equally among {n} classrooms.",
          "How many books are in the library now?", "How many books does each classroom get?"),
    Story(("dollars",), "{name} saves {b} dollars a week for {a} weeks.", "{name} has {a} dollars in a piggy bank.",
          ("{He} earns {n} dollars mowing lawns.", "{He} gets {n} dollars as a birthday gift."),
          ("{He} spends {n} dollars on a new game.", "{He} spends {n} dollars on books."),
          "Thanks to a matching gift, {he} ends up with {times} as much money.",
          "{He} splits the money equally among {n} friends.",
          "How many dollars does {name} have now?", "How many dollars does each friend get?"),
    Story(("eggs",), "A farm has {a} hens that each lay {b} eggs.", "A farmer collects {a} eggs.",
          ("The farmer buys {n} more eggs at the market.",),
          ("{n} eggs break on the way home.", "The farmer uses {n} eggs for breakfast."),
          "By Friday the farmer has {times} as many eggs.", "The eggs are packed equally into {n} cartons.",
          "How many eggs does the farmer have now?", "How many eggs are in each carton?"),
    Story(("tulips", "roses", "daisies"), "{name} plants {a} rows of {b} {item}.", "{name} plants {a} {item}.",
          ("{He} plants {n} more {item}.",), ("Rabbits eat {n} {item}.", "{He} picks {n} {item} for a vase."),
          "By spring there are {times} as many {item}.", "{He} divides the {item} equally among {n} flower beds.",
          "How many {item} are in the garden now?", "How many {item} does each flower bed get?"),
    Story(("stickers", "cards", "marbles"), "{name} buys {a} packs of {b} {item}.", "{name} has {a} {item}.",
          ("{He} wins {n} {item} in a contest.", "{He} receives {n} {item} from a friend."),
          ("{He} trades away {n} {item}.", "{He} loses {n} {item}."),
          "After a swap meet {he} has {times} as many {item}.",
          "{He} shares the {item} equally among {n} classmates.",
          "How many {item} does {name} have now?", "How many {item} does each classmate get?"),
    Story(("passengers",), "A train has {a} carriages with {b} passengers in each carriage.",
          "A bus leaves the depot with {a} passengers.",
          ("At the next stop {n} passengers get on.",), ("At the next stop {n} passengers get off.",),
          "After the main station there are {times} as many passengers on board.",
          "At the end of the line the passengers split equally into {n} tour groups.",
          "How many passengers are on board now?", "How many passengers are in each tour group?"),
)
NAMES = (("Ava", "she"), ("Ben", "he"), ("Chloe", "she"), ("Diego", "he"), ("Emma", "she"), ("Farah", "she"),
         ("Hiro", "he"), ("Ines", "she"), ("Jamal", "he"), ("Kofi", "he"), ("Lena", "she"), ("Mateo", "he"))
TIMES = {2: "twice", 3: "three times"}


def word_problem(seed: int, steps: int = 2, digits: int = 2) -> tuple[str, int]:
    """(question, answer) for `seed`, with `steps` operations (2..4) and quantities below
    10**digits (added and removed amounts too; products and scaling can exceed it)."""
    if not 2 <= steps <= 4 or not 1 <= digits <= 4:
        raise ValueError(f"word problems take steps 2..4 and digits 1..4, got steps={steps} digits={digits}")
    rng = random.Random(seed)
    story = rng.choice(STORIES)
    name, he = rng.choice(NAMES)
    words = {"name": name, "He": he.capitalize(), "he": he, "him": "her" if he == "she" else "him",
             "item": rng.choice(story.items)}
    low, high = 10 ** (digits - 1) + 1, 10**digits - 1  # digits=1: 2..9; digits=2: 11..99

    if rng.random() < 0.5:  # groups: the first operation is a multiplication
        a, b = rng.randint(2, 9), rng.randint(low, high)
        total, sentences, left = a * b, [story.groups.format(a=a, b=b, **words)], steps - 1
    else:
        total = rng.randint(low, high)
        sentences, left = [story.start.format(a=total, **words)], steps

    scaled, shared = False, False
    for i in range(left):
        divisors = [d for d in range(2, 10) if total % d == 0 and d < total]
        if i == left - 1 and divisors and rng.random() < 1 / 3:
            n = rng.choice(divisors)
            total, shared = total // n, True
            sentences.append(story.share.format(n=n, **words))
            continue
        kind = rng.choice(("add", "remove", "remove") if scaled else ("add", "remove", "remove", "scale"))
        if kind == "remove" and total < 3:  # a removal of at least 2 must leave at least 1
            kind = "add"
        if kind == "scale":
            factor = rng.choice((2, 3))
            total, scaled = total * factor, True
            sentences.append(story.scale.format(times=TIMES[factor], **words))
        elif kind == "add":
            n = rng.randint(2, high)
            total += n
            sentences.append(rng.choice(story.add).format(n=n, **words))
        else:
            n = rng.randint(2, min(high, total - 1))
            total -= n
            sentences.append(rng.choice(story.remove).format(n=n, **words))

    sentences.append((story.ask_each if shared else story.ask_total).format(**words))
    return " ".join(sentences), total
