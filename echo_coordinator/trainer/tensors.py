"""The trainer's plain helpers, torch-free: tensors to disk, micro-batches, memory back to the OS."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def save_tensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write float32 tensors as safetensors; the file is complete or absent."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def release_freed_memory() -> None:
    """Hand what torch freed back to the OS. glibc keeps freed heap memory otherwise, so the
    trainer would hold a step's peak (~10 GB on a CPU) between steps, squeezing the nodes that
    share its machine. (Not glibc, e.g. macOS: nothing to do.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def micro_batches(lengths: list[int], max_tokens: int, units: list[list[int]] | None = None) -> list[list[int]]:
    """Sample indices grouped so each group's padded size (count x longest) stays within
    `max_tokens` (a longer sample goes alone); longest first, so similar lengths share padding.
    `units`: indices that must share a group (a batch judged in the step, `step_checks`)."""
    units = [[i] for i in range(len(lengths))] if units is None else [sorted(u, key=lambda i: -lengths[i]) for u in units]
    groups: list[list[int]] = []
    for unit in sorted(units, key=lambda u: -lengths[u[0]]):
        if groups and (len(groups[-1]) + len(unit)) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1] += unit
        else:
            groups.append(list(unit))
    return groups


def prompt_groups(samples, max_tokens: int) -> list[list[int]]:
    """Indices of samples that share a prompt (a group's G samples), split so each part's
    completions stay within `max_tokens` (`micro_batches`)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(i)
    parts = []
    for indices in by_prompt.values():
        lengths = [len(samples[i].completion_ids) for i in indices]
        parts += [[indices[j] for j in part] for part in micro_batches(lengths, max_tokens)]
    return parts


def forward_batches(parts: list[list[int]], lengths: list[int], max_tokens: int) -> list[list[list[int]]]:
    """`prompt_groups`' parts gathered, in order, into batches whose padded completions (rows x
    longest, `lengths` per sample) stay within `max_tokens`: one forward serves several groups."""
    batches: list[list[list[int]]] = []
    rows = longest = 0
    for part in parts:
        part_longest = max(lengths[i] for i in part)
        if batches and (rows + len(part)) * max(longest, part_longest) <= max_tokens:
            batches[-1].append(part)
            rows, longest = rows + len(part), max(longest, part_longest)
        else:
            batches.append([part])
            rows, longest = len(part), part_longest
    return batches
