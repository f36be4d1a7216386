"""Choosing how a node reaches a version: the cheapest chain of verified updates.

An update goes `from_version -> to_version` (a delta: v-1 -> v; a snapshot or LoRA adapter:
0 -> v, applicable from anywhere since it replaces the weights). A node at `held` that wants
`target` picks the chain with the fewest bytes: a late joiner at version 3 takes the latest
snapshot and the few deltas after it instead of replaying every delta since 3.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from protocols.errors import InvalidValue


@dataclass(frozen=True)
class Step:
    from_version: int  # 0 with `replaces` means: applies from any version
    to_version: int
    nbytes: int
    replaces: bool = False  # a snapshot: sets the weights instead of adding to them


def plan(held: int, target: int, steps: list[Step]) -> list[Step]:
    """Cheapest list of steps from `held` to `target` (empty if already there). Raises
    InvalidValue if `target` cannot be reached from what is offered (a version gap)."""
    if held == target:
        return []
    best: dict[int, int] = {held: 0}
    previous: dict[int, tuple[int, Step]] = {}
    queue = [(0, held)]
    while queue:
        cost, version = heapq.heappop(queue)
        if version == target:
            break
        if cost > best.get(version, cost):
            continue
        for step in steps:
            applies = step.replaces or step.from_version == version
            if not applies or step.to_version <= version or step.to_version > target:
                continue
            new_cost = cost + step.nbytes
            if new_cost < best.get(step.to_version, new_cost + 1):
                best[step.to_version] = new_cost
                previous[step.to_version] = (version, step)
                heapq.heappush(queue, (new_cost, step.to_version))
    if target not in previous:
        raise InvalidValue(f"no chain of offered updates leads from version {held} to {target}")
    chain, version = [], target
    while version != held:
        version, step = previous[version]
        chain.append(step)
    return chain[::-1]
