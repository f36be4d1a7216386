"""A Sokoban board: walls, goals, boxes and the player, the one move rule, and its text form.

Positions are (row, col) with row 0 at the top. A `Level` is immutable; `move` returns the next
one, so a solver or a replay can keep any state it has seen. The board is `size` x `size` and its
outer ring is always wall, so a move can never step off the grid.

Text form, one character per cell, rows top to bottom joined by "\\n":

    #  wall          .  goal           @  player
    _  floor         $  box            +  player on a goal
                     *  box on a goal

Floor is "_" rather than a space: language-model tokenizers merge and strip runs of spaces, and a
visible character keeps every row the same width for the reader.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

Pos = tuple[int, int]

# One letter per direction, as in the standard LURD notation for Sokoban solutions.
DIRECTIONS: dict[str, Pos] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
WORDS: dict[str, str] = {"U": "up", "D": "down", "L": "left", "R": "right"}

WALL, FLOOR, GOAL, BOX, BOX_ON_GOAL, PLAYER, PLAYER_ON_GOAL = "#", "_", ".", "$", "*", "@", "+"
LEGEND = (
    f"{WALL} wall, {FLOOR} floor, {GOAL} goal, {BOX} box, {BOX_ON_GOAL} box on a goal, "
    f"{PLAYER} you, {PLAYER_ON_GOAL} you standing on a goal"
)


class BoardError(ValueError):
    """Board text that does not describe one valid level (only ever from trusted text: tests, fixtures)."""


def step(pos: Pos, direction: str) -> Pos:
    dr, dc = DIRECTIONS[direction]
    return pos[0] + dr, pos[1] + dc


@dataclass(frozen=True)
class Level:
    size: int
    walls: frozenset[Pos]  # includes the outer ring
    goals: frozenset[Pos]
    boxes: frozenset[Pos]  # as many as goals
    player: Pos

    def move(self, direction: str) -> Level | None:
        """The level after the player steps one cell (pushing a box ahead of it), or None when the
        move is blocked: a wall ahead, or a box with a wall or another box behind it."""
        ahead = step(self.player, direction)
        if ahead in self.walls:
            return None
        if ahead not in self.boxes:
            return replace(self, player=ahead)
        beyond = step(ahead, direction)
        if beyond in self.walls or beyond in self.boxes:
            return None
        return replace(self, boxes=(self.boxes - {ahead}) | {beyond}, player=ahead)

    @property
    def on_goals(self) -> int:
        return len(self.boxes & self.goals)

    @property
    def solved(self) -> bool:
        return self.boxes <= self.goals

    def floor(self) -> list[Pos]:
        """Every non-wall cell, in reading order (sorted, so seeded choices over it are stable)."""
        return [(r, c) for r in range(self.size) for c in range(self.size) if (r, c) not in self.walls]

    def render(self) -> str:
        return "\n".join("".join(self._char((r, c)) for c in range(self.size)) for r in range(self.size))

    def _char(self, pos: Pos) -> str:
        if pos in self.walls:
            return WALL
        goal = pos in self.goals
        if pos == self.player:
            return PLAYER_ON_GOAL if goal else PLAYER
        if pos in self.boxes:
            return BOX_ON_GOAL if goal else BOX
        return GOAL if goal else FLOOR

    @classmethod
    def parse(cls, text: str) -> Level:
        """The inverse of `render`, for hand-written levels. Raises BoardError on malformed text."""
        rows = text.strip("\n").split("\n")
        size = len(rows)
        if size < 3 or any(len(row) != size for row in rows):
            raise BoardError(f"a board is a square of at least 3x3 characters, got row widths "
                             f"{[len(row) for row in rows]}")
        cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
        unknown = set(cells.values()) - set(WALL + FLOOR + GOAL + BOX + BOX_ON_GOAL + PLAYER + PLAYER_ON_GOAL)
        if unknown:
            raise BoardError(f"unknown board characters {sorted(unknown)}; use the legend: {LEGEND}")
        players = [p for p, ch in cells.items() if ch in PLAYER + PLAYER_ON_GOAL]
        walls = frozenset(p for p, ch in cells.items() if ch == WALL)
        goals = frozenset(p for p, ch in cells.items() if ch in GOAL + BOX_ON_GOAL + PLAYER_ON_GOAL)
        boxes = frozenset(p for p, ch in cells.items() if ch in BOX + BOX_ON_GOAL)
        ring = {p for p in cells if 0 in p or size - 1 in p}
        if len(players) != 1:
            raise BoardError(f"a board needs exactly one player (@ or +), found {len(players)}")
        if len(boxes) != len(goals) or not boxes:
            raise BoardError(f"a board needs as many boxes as goals, at least one; found {len(boxes)} "
                             f"boxes and {len(goals)} goals")
        if not ring <= walls:
            raise BoardError("the outer ring of a board must be all wall (#)")
        return cls(size=size, walls=walls, goals=goals, boxes=boxes, player=players[0])
