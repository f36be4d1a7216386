"""A bounded Sokoban solver: a solution with the fewest box pushes, or None.

The search runs over pushes, not steps: a state is the set of box cells plus the region the player
can walk to without pushing anything, named by that region's smallest cell. Walking inside a region
is free, so states are few (a 6x6, two-box level has at most a few hundred).

The order is A*: breadth-first over pushes, but states are taken in order of pushes made plus a lower
bound on the pushes still needed (each box's push distance to its nearest goal, ignoring the other
boxes). The bound never overestimates and changes by at most one per push, so the first solved state
taken is push-optimal, as with plain BFS; it makes 10x10 four-box levels tens of times cheaper.
Boxes are never pushed onto a cell with no push distance at all: from there not even a lone box
could reach a goal (corners, most wall-hugging cells).

The answer is a move string in LURD notation: one letter per player step, upper case where the step
pushes a box (`len(s)` moves, `sum(map(str.isupper, s))` pushes). The walk between pushes is a
shortest path, but the total step count need not be minimal. `max_states` caps the work so a search
can never hang; hitting it returns None, as does an unsolvable level.
"""

from __future__ import annotations

import heapq
from collections import deque

from tasks.sokoban.level import DIRECTIONS, Level, Pos, step

MAX_STATES = 50_000  # distinct (region, boxes) states, a few seconds of Python at most

State = tuple[Pos, frozenset[Pos]]  # (smallest cell of the player's region, box cells)
Push = tuple[Pos, str]  # (box cell before the push, direction)
Graph = dict[Pos, tuple[Pos, ...]]  # floor cell -> its floor neighbours


def solve(level: Level, max_states: int = MAX_STATES) -> str | None:
    if level.solved:
        return ""
    distance = push_distances(level)
    if not level.boxes <= distance.keys():
        return None

    def estimate(boxes: frozenset[Pos]) -> int:  # admissible: each push moves one box one cell
        return sum(distance[box] for box in boxes)

    graph = floor_graph(level)
    start_region = reachable(level.player, level.boxes, graph)
    start: State = (min(start_region), level.boxes)
    pushes_to: dict[State, int] = {start: 0}
    parents: dict[State, tuple[State, Push] | None] = {start: None}
    # (pushes + estimate, -pushes, insertion number, ...): deeper first among equals, then FIFO, so
    # the search order and hence the solution never depend on set iteration order.
    frontier = [(estimate(level.boxes), 0, 0, start, start_region)]
    counter = 0
    while frontier:
        _, neg_pushes, _, state, region = heapq.heappop(frontier)
        pushes, boxes = -neg_pushes, state[1]
        if pushes > pushes_to[state]:
            continue  # a stale entry: this state was reached more cheaply since
        if boxes <= level.goals:
            return _moves(level, _pushes(parents, state))
        for box in sorted(boxes):
            for direction in DIRECTIONS:
                behind, beyond = step(box, _OPPOSITE[direction]), step(box, direction)
                if behind not in region or beyond not in distance or beyond in boxes:
                    continue
                moved = (boxes - {box}) | {beyond}
                next_region = reachable(box, moved, graph)
                child: State = (min(next_region), moved)
                if child in pushes_to and pushes_to[child] <= pushes + 1:
                    continue
                pushes_to[child], parents[child] = pushes + 1, (state, (box, direction))
                if len(pushes_to) > max_states:
                    return None
                counter += 1
                entry = (pushes + 1 + estimate(moved), -(pushes + 1), counter, child, next_region)
                heapq.heappush(frontier, entry)
    return None


def push_distances(level: Level) -> dict[Pos, int]:
    """For each cell from which a box, alone on the board, can be pushed onto some goal: the fewest
    pushes that takes. A box on any other cell is stuck off-goal for good (a deadlock).

    Found backwards from the goals: a box reaches `cell` from `cell - d` when the player can stand at
    `cell - 2d` to push it."""
    distance = {goal: 0 for goal in level.goals}
    frontier = deque(sorted(level.goals))
    while frontier:
        cell = frontier.popleft()
        for direction in DIRECTIONS:
            back = _OPPOSITE[direction]
            origin = step(cell, back)
            stand = step(origin, back)
            if origin not in distance and origin not in level.walls and stand not in level.walls:
                distance[origin] = distance[cell] + 1
                frontier.append(origin)
    return distance


def reachable(start: Pos, boxes: frozenset[Pos], graph: Graph) -> set[Pos]:
    """Cells the player can walk to from `start` without pushing a box."""
    seen = {start}
    stack = [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen and nxt not in boxes:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def floor_graph(level: Level) -> Graph:
    """Each floor cell's floor neighbours, computed once: flood fills are most of the solver's time."""
    return {cell: tuple(n for d in DIRECTIONS if (n := step(cell, d)) not in level.walls)
            for cell in level.floor()}


def walk(start: Pos, target: Pos, boxes: frozenset[Pos], walls: frozenset[Pos]) -> str | None:
    """A shortest push-free path as lower-case LURD letters, or None when `target` is out of reach."""
    parents: dict[Pos, tuple[Pos, str] | None] = {start: None}
    frontier = deque([start])
    while frontier:
        cell = frontier.popleft()
        if cell == target:
            path = []
            while (link := parents[cell]) is not None:
                cell, letter = link
                path.append(letter)
            return "".join(reversed(path))
        for direction in DIRECTIONS:
            nxt = step(cell, direction)
            if nxt not in parents and nxt not in walls and nxt not in boxes:
                parents[nxt] = (cell, direction.lower())
                frontier.append(nxt)
    return None


_OPPOSITE = {"U": "D", "D": "U", "L": "R", "R": "L"}


def _pushes(parents: dict[State, tuple[State, Push] | None], state: State) -> list[Push]:
    pushes = []
    while (link := parents[state]) is not None:
        state, push = link
        pushes.append(push)
    return pushes[::-1]


def _moves(level: Level, pushes: list[Push]) -> str:
    """Replays the pushes from the real start cell, walking a shortest path to each push."""
    moves, player, boxes = [], level.player, level.boxes
    for box, direction in pushes:
        path = walk(player, step(box, _OPPOSITE[direction]), boxes, level.walls)
        assert path is not None, "a push the search found must be reachable on replay"
        moves.append(path + direction)
        boxes, player = (boxes - {box}) | {step(box, direction)}, box
    return "".join(moves)
