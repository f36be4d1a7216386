"""Sokoban, a multi-turn environment: push every box onto a goal, a few moves per model turn.

- `level`     the board (walls, goals, boxes, player), the move rule, and its text form
- `solver`    bounded breadth-first search for a push-optimal solution
- `generate`  seeded procedural levels: carve a room, pull boxes off their goals, confirm by solving
- `env`       `SokobanTask` (parameters) and `SokobanEpisode` (prompt, move parsing, score)

Each module imports only those above it.
"""

from tasks.sokoban.env import SokobanEpisode, SokobanTask

__all__ = ["SokobanEpisode", "SokobanTask"]
