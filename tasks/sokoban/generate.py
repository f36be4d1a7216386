"""Procedural Sokoban levels from a seeded rng, solvable by construction and confirmed by the solver.

The method follows gym-sokoban (Schrader 2018), the generator that LLM-agent RL work on Sokoban
(RAGEN among others) builds on:

1. carve a room: a random walk inside the wall ring turns interior walls into floor until about
   `ROOM_FRACTION` of the interior is open (a walk's trail is always connected);
2. put every box on its own goal and the player on another floor cell: a solved position;
3. play backwards: the player *pulls* random boxes in short straight runs, walking freely between
   runs. Every pull is a push run in reverse, so the forward puzzle is solvable;
4. keep the draw only if the solver confirms it: solvable, no box starting on a goal (so an idle
   player scores 0), at least `min_pushes` box pushes, and a solution of at most `max_moves` steps
   (so it fits the episode's turn and move budget).

A rejected draw is followed by the next draw from the same rng, so a level is a pure function of
(parameters, seed). Parameters that no draw satisfies in `MAX_ATTEMPTS` raise GenerationError.
"""

from __future__ import annotations

import random
from dataclasses import replace

from tasks.sokoban.level import DIRECTIONS, Level, Pos, step
from tasks.sokoban.solver import floor_graph, reachable, solve

ROOM_FRACTION = (0.55, 0.9)  # of the (size-2)^2 interior, drawn per level: open rooms vs corridors
PULLS_PER_BOX = (1, 3)  # pull runs in the reverse game, per box: more runs, more scrambled levels
EXTRA_PULLS = 8  # at most this many more runs to move boxes still on goals off them
RUN_CONTINUE = 0.5  # chance a pull run goes one more cell: runs of 1, 2, 3... cells, halving in odds
MAX_ATTEMPTS = 300  # rejected draws before giving up; typical 6x6 levels need 1-3
SOLVER_STATES = 5_000  # per draw: a level needing more search is rejected (bounds 10x10 time)


class GenerationError(ValueError):
    """No level met the constraints within MAX_ATTEMPTS draws: the parameters ask too much."""


def generate(rng: random.Random, size: int, boxes: int, min_pushes: int, max_moves: int) -> tuple[Level, str]:
    """A level and one push-optimal solution (LURD letters, see `solver`)."""
    for _ in range(MAX_ATTEMPTS):
        level = _draw(rng, size, boxes)
        if level is None or level.boxes & level.goals:
            continue
        solution = solve(level, max_states=SOLVER_STATES)
        if solution is None or len(solution) > max_moves:
            continue
        if sum(map(str.isupper, solution)) >= min_pushes:
            return level, solution
    raise GenerationError(
        f"no {size}x{size} Sokoban level with {boxes} boxes, >= {min_pushes} pushes and a solution of "
        f"<= {max_moves} moves in {MAX_ATTEMPTS} draws; lower min_solution or boxes, or raise size, "
        f"max_turns or max_moves_per_turn"
    )


def _draw(rng: random.Random, size: int, boxes: int) -> Level | None:
    """One candidate: carve, place solved, pull backwards. None when the room is too cramped."""
    interior = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    target = max(round(rng.uniform(*ROOM_FRACTION) * len(interior)), 2 * boxes + 2)
    floor = _carve(rng, interior, target)
    cells = sorted(floor)  # sorted: rng choices must not depend on set iteration order
    if len(cells) < boxes + 1:
        return None
    goals = rng.sample(cells, boxes)
    player = rng.choice([c for c in cells if c not in goals])
    walls = frozenset((r, c) for r in range(size) for c in range(size)) - floor
    solved = Level(size=size, walls=walls, goals=frozenset(goals), boxes=frozenset(goals), player=player)
    return _pull_backwards(rng, solved, pulls=rng.randint(PULLS_PER_BOX[0] * boxes, PULLS_PER_BOX[1] * boxes))


def _carve(rng: random.Random, interior: list[Pos], target: int) -> frozenset[Pos]:
    inside = set(interior)
    target = min(target, len(inside))
    cell = rng.choice(interior)
    floor = {cell}
    # Bounded: a walk on a grid of at most 64 cells covers 90 % of it in far fewer steps.
    for _ in range(200 * len(interior)):
        if len(floor) >= target:
            break
        nxt = step(cell, rng.choice("UDLR"))
        if nxt in inside:
            cell = nxt
            floor.add(cell)
    return frozenset(floor)


def _pull_backwards(rng: random.Random, solved: Level, pulls: int) -> Level:
    """The reverse game, from the solved position. A pull drags a box one cell toward the player,
    who backs away: run forwards, that is a push. Walking is reversible, so between pulls the player
    may go anywhere it can reach, and it ends on a random reachable cell."""
    graph, walls, goals = floor_graph(solved), solved.walls, solved.goals
    boxes, player = solved.boxes, solved.player
    # Past `pulls`, keep going while a box sits on a goal (the draw is rejected if one still does).
    for done in range(pulls + EXTRA_PULLS):
        if done >= pulls and not boxes & goals:
            break
        region = reachable(player, boxes, graph)
        options = [(box, d) for box in sorted(boxes) for d in DIRECTIONS
                   if step(box, d) in region and _free(step(step(box, d), d), boxes, walls)]
        # Boxes still on a goal go first: the level is rejected unless every box has left its goal.
        options = [o for o in options if o[0] in goals] or options
        if not options:
            break
        box, d = rng.choice(options)
        while True:  # a run of pulls in one line, so boxes travel more than a cell from their goals
            boxes, player, box = (boxes - {box}) | {step(box, d)}, step(step(box, d), d), step(box, d)
            if rng.random() > RUN_CONTINUE or not _free(step(player, d), boxes, walls):
                break
    return replace(solved, boxes=boxes, player=rng.choice(sorted(reachable(player, boxes, graph))))


def _free(cell: Pos, boxes: frozenset[Pos], walls: frozenset[Pos]) -> bool:
    return cell not in walls and cell not in boxes
