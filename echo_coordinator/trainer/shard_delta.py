"""Full-mode publishing under FSDP without gathering the weights.

A full-mode update is, per weight, the k largest entries of `target - view` (what the trainer
holds minus what the nodes hold), quantized to int8 with one scale (`protocols.delta`,
topk-int8). Sharded, every rank keeps its shard of the view (flat float32, host memory) beside its
shard of the weights, and per weight:
  1. the ranks find the tensor's k-th largest |residual| together, a byte at a time (a radix
     select: four all-reduced 256-bucket histograms of the float32 bit patterns, whose order is
     the order of the non-negative values), and share how many entries each holds above it and
     equal to it (ties go to the lowest ranks first);
  2. every rank takes its entries of the top k, and the ranks all-reduce their largest |value|:
     the payload's one scale;
  3. every rank encodes its part of the payload with that scale and applies it to its shard of
     the view (`delta.apply`: the very arithmetic the nodes run);
  4. rank 0 gathers the parts, 5 bytes per kept entry, and joins them: the payload the unsharded
     publisher would make from the gathered weights (ties aside, the same entries).
So what crosses the ranks per update is the encoded delta itself (about 5 bytes for 1 % of the
entries at the default density) and a few small collectives per weight, never the weights.
Rank 0 publishes the payloads and advances its whole copy of the view with them (the verifier
and snapshots read it).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from echo_coordinator.trainer import distributed
from protocols import delta


def flat_ranges(p: DTensor) -> list[tuple[int, int]]:
    """Every rank's flat element range [lo, hi) of `p`: FSDP2 deals dim 0 in chunks of
    ceil(rows / ranks), the last ones shorter or empty."""
    rows, world = p.shape[0], p.device_mesh.size()
    chunk, row = -(-rows // world), int(np.prod(p.shape[1:], dtype=np.int64))
    ranges = [(min(rows, r * chunk) * row, min(rows, (r + 1) * chunk) * row) for r in range(world)]
    lo, hi = ranges[p.device_mesh.get_local_rank()]
    if p.placements[0].dim != 0 or p.to_local().numel() != hi - lo:
        raise distributed.DistributedError(f"a weight of shape {tuple(p.shape)} is not sharded as FSDP2 shards "
                                           f"dim 0: this rank holds {tuple(p.to_local().shape)}")
    return ranges


class ShardView:
    """This rank's shard of what full-mode nodes hold, and its part in each update (collective:
    every rank makes and calls it with the same weights, in the same order)."""

    def __init__(self, params: dict[str, DTensor], view: dict[str, np.ndarray] | None):
        """`view`: rank 0's whole view of every weight (None on the others), dealt out once."""
        self.params, self.group = params, distributed.group()
        self.ranges = {name: flat_ranges(p) for name, p in params.items()}
        self.rank = self.group.rank()
        self.held = {}
        for name, p in params.items():
            source = (torch.from_numpy(np.array(view[name], dtype=np.float32)) if view is not None
                      else torch.empty(p.shape, dtype=torch.float32))
            shard = distribute_tensor(source.to(p.device), p.device_mesh, p.placements).to_local()
            self.held[name] = shard.reshape(-1).cpu().numpy().copy()

    def encode(self, density: float) -> dict[str, bytes]:
        """Every weight's topk-int8 payload toward the trainer's weights (rank 0; {} on the
        others); advances every rank's shard of the view as the nodes will on applying them.
        Each collective covers every weight at once (a handful per update, not per weight)."""
        names = list(self.params)
        device = next(iter(self.params.values())).to_local().device
        residuals = []
        for name in names:
            local = self.params[name].to_local().detach().reshape(-1).float().cpu().numpy()
            residuals.append(np.subtract(local, self.held[name], out=np.empty(local.shape, dtype=np.float32)))
        ks = [delta.topk_count(self.params[name].numel(), density) for name in names]
        chosen, counts = top_k([np.abs(r).view(np.uint32) for r in residuals], ks, self.group, device)
        kept = [r[c] for r, c in zip(residuals, chosen)]
        peaks = torch.tensor([float(np.abs(v).max()) if v.size else 0.0 for v in kept], device=device)
        dist.all_reduce(peaks, dist.ReduceOp.MAX, group=self.group)
        parts = []
        for name, c, v, peak in zip(names, chosen, kept, peaks.cpu().tolist()):
            parts.append(delta.topk_payload(c, v, f"tensor {name!r}", peak=peak))
            self.held[name] = delta.apply(self.held[name], parts[-1], delta.Encoding.TOPK_INT8, name=name)
        sizes = [[8 + 5 * n for n in per_rank] for per_rank in zip(*counts)]  # [rank][weight], bytes
        every = self._gather(b"".join(parts), [sum(row) for row in sizes], device)
        if every is None:
            return {}
        ends = [np.cumsum(row) for row in sizes]
        return {name: delta.topk_join([(self.ranges[name][r][0], every[r][ends[r][t] - sizes[r][t]:ends[r][t]])
                                       for r in range(len(every))])
                for t, name in enumerate(names)}

    def _gather(self, part: bytes, sizes: list[int], device) -> list[bytes] | None:
        """Every rank's `part` (of the given sizes) on rank 0, in rank order; None elsewhere."""
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(part)] = torch.frombuffer(bytearray(part), dtype=torch.uint8)
        padded = padded.to(device)
        into = [torch.empty_like(padded) for _ in sizes] if self.rank == 0 else None
        dist.gather(padded, into, dst=0, group=self.group)
        if into is None:
            return None
        return [t.cpu().numpy()[:size].tobytes() for t, size in zip(into, sizes)]


def top_k(keys: list[np.ndarray], ks: list[int], group, device) -> tuple[list[np.ndarray], list[list[int]]]:
    """For each tensor t (every rank holding a shard of each, `keys[t]`): this rank's indices
    (ascending) of the `ks[t]` largest keys of all shards together, ties to the lowest ranks and
    indices first, and how many each rank holds (collective). Keys are float32 bit patterns of
    non-negative values, which order as the values do; the k-th is found a byte at a time."""
    need, thresholds, candidates = np.array(ks, dtype=np.int64), np.zeros(len(keys), dtype=np.int64), list(keys)
    for shift in (24, 16, 8, 0):
        hist = np.stack([np.bincount((c >> shift) & 0xFF, minlength=256) for c in candidates]) if keys else \
            np.zeros((0, 256), dtype=np.int64)
        hist = torch.from_numpy(hist).to(device)
        dist.all_reduce(hist, group=group)
        from_top = np.cumsum(hist.cpu().numpy()[:, ::-1], axis=1)  # keys in buckets 255, 255..254, ...
        for t in range(len(keys)):
            i = int(np.searchsorted(from_top[t], need[t]))  # the bucket holding the need-th largest
            need[t] -= from_top[t, i - 1] if i else 0
            thresholds[t] |= (255 - i) << shift
            candidates[t] = candidates[t][((candidates[t] >> shift) & 0xFF) == 255 - i]
    above = [np.flatnonzero(k > th) for k, th in zip(keys, thresholds)]
    ties = [np.flatnonzero(k == th) for k, th in zip(keys, thresholds)]
    mine = torch.tensor([[a.size, t.size] for a, t in zip(above, ties)], dtype=torch.int64,
                        device=device).reshape(len(keys), 2)
    every = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(every, mine, group=group)
    held = np.stack([e.cpu().numpy() for e in every], axis=1)  # [tensor][rank] -> (above, ties)
    chosen, counts = [], []
    for t in range(len(keys)):
        takes, left = [], int(need[t])
        for tie in held[t, :, 1]:  # the ties the top k needs, from the lowest ranks first
            takes.append(min(left, int(tie)))
            left -= takes[-1]
        chosen.append(np.sort(np.concatenate([above[t], ties[t][: takes[group.rank()]]])))
        counts.append([int(a) + take for a, take in zip(held[t, :, 0], takes)])
    return chosen, counts
