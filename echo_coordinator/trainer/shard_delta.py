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
        others); advances every rank's shard of the view as the nodes will on applying them."""
        payloads = {}
        for name, p in self.params.items():
            where = f"tensor {name!r}"
            device = p.to_local().device
            k = delta.topk_count(p.numel(), density)
            local = p.to_local().detach().reshape(-1).float().cpu().numpy()
            residual = np.subtract(local, self.held[name], out=np.empty(local.shape, dtype=np.float32))
            chosen, counts = top_k(np.abs(residual).view(np.uint32), k, self.group, device)
            kept = residual[chosen]
            peak = torch.tensor([float(np.abs(kept).max()) if kept.size else 0.0], device=device)
            dist.all_reduce(peak, dist.ReduceOp.MAX, group=self.group)
            part = delta.topk_payload(chosen, kept, where, peak=float(peak.item()))
            self.held[name] = delta.apply(self.held[name], part, delta.Encoding.TOPK_INT8, name=name)
            parts = self._gather(part, [8 + 5 * c for c in counts], device)
            if parts is not None:
                payloads[name] = delta.topk_join([(lo, b) for (lo, _), b in zip(self.ranges[name], parts)])
        return payloads

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


def top_k(keys: np.ndarray, k: int, group, device) -> tuple[np.ndarray, list[int]]:
    """This rank's indices (ascending) of the k largest of every rank's `keys` together, ties
    to the lowest ranks and indices first, and how many each rank holds (collective). `keys`:
    float32 bit patterns of non-negative values, which order as the values do."""
    need, threshold, candidates = k, 0, keys
    for shift in (24, 16, 8, 0):
        counts = torch.from_numpy(np.bincount((candidates >> shift) & 0xFF, minlength=256)).to(device)
        dist.all_reduce(counts, group=group)
        from_top = np.cumsum(counts.cpu().numpy()[::-1])  # keys in buckets 255, 255..254, ...
        i = int(np.searchsorted(from_top, need))  # the bucket holding the need-th largest
        need -= int(from_top[i - 1]) if i else 0
        threshold |= (255 - i) << shift
        candidates = candidates[((candidates >> shift) & 0xFF) == 255 - i]
    above, ties = np.flatnonzero(keys > threshold), np.flatnonzero(keys == threshold)
    mine = torch.tensor([above.size, ties.size], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(every, mine, group=group)
    held = [t.cpu().tolist() for t in every]  # [above, ties] per rank
    takes, left = [], need
    for _, tie in held:  # the ties the top k needs, from the lowest ranks first
        takes.append(min(left, tie))
        left -= takes[-1]
    chosen = np.sort(np.concatenate([above, ties[: takes[group.rank()]]]))
    return chosen, [a + t for (a, _), t in zip(held, takes)]
