"""Knights-and-knaves logic puzzles (knights always tell the truth, knaves always lie).

- `puzzle`  statement grammar (`Is`, `Join`), English rendering, truth-table solver, and the
            generator that keeps only puzzles with exactly one consistent assignment
- `verify`  reads a free-text reply into a knight/knave assignment and grades it
- `task`    `KnightsTask`, the single-turn environment tying the two together

Pure Python, stdlib only.
"""

from tasks.knights.task import KnightsTask

__all__ = ["KnightsTask"]
