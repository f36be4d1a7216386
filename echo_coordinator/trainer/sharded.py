"""`[trainer] sharding = "fsdp"`: parameters, gradients and optimiser state sharded across the
trainer ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`), so each rank holds about 1/N of
them.

The units: each decoder layer, and a root over the rest (embeddings, final norm, head: a tied head
shares its unit with the embeddings). Each unit's weights are gathered for its forward and backward
and dropped after, and gradients are reduce-scattered, summed (the loss is already divided by the
whole step's tokens, as in `distributed.sum_gradients`). Every FSDP collective must be called by
every rank in the same order: the learner keeps the ranks in lockstep (the same number of forwards
per optimiser step, `idle` rounds where a rank has fewer samples), and rank 0's forwards outside a
step (verification) run on a whole copy of the weights each rank gathered once (`gather`): what
rank 0 loads into that copy and computes with it is its own, and is dropped by `release`.

What rank 0 publishes in LoRA mode, the adapter, is gathered tensor by tensor (`full`); in full
mode each update is encoded where the shards live (`shard_delta`). Checkpoints save and load the
optimiser state and, in full mode, the weights sharded with torch.distributed.checkpoint (every
rank writes its shards; `read_weights` reads them back whole in one process).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from echo_coordinator.trainer import distributed


class Scored(torch.nn.Module):
    """The causal LM with the vocabulary projection applied only at the positions a token is scored
    (`where`, (B, L-1)), as one module: the root FSDP unit, whose forward gathers the embeddings,
    the final norm and the head around the whole pass."""

    def __init__(self, causal: torch.nn.Module):
        super().__init__()
        self.causal = causal

    def forward(self, ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        hidden = self.causal.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]  # (B, L-1, H)
        return self.causal.lm_head(hidden[where])


def shard(scored: Scored, device: torch.device, compute: torch.dtype | None = None) -> list[FSDPModule]:
    """Shard `scored` across the trainer ranks in place; its FSDP units, the root first. `compute`:
    the dtype fp32 weights are gathered in for forward and backward (bf16 over full mode's master
    weights; gradients are reduced in fp32), None to compute in the weights' own."""
    mesh = distributed.mesh(device.type)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
    for layer in scored.causal.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(scored, mesh=mesh, mp_policy=policy)
    units = [m for m in scored.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        # Sum, not FSDP's default mean: the loss is already normalised over every rank's tokens.
        # (gloo has no pre-multiplied sum, so the plain sum is forced.)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return units


def idle_round(scored: Scored, device: torch.device) -> None:
    """A forward and backward that changes no gradient, for a rank with fewer micro-batches than
    another in this optimiser step: every rank must gather and reduce each unit as often."""
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    (scored(ids, torch.ones((1, 1), dtype=torch.bool, device=device)).sum() * 0.0).backward()


def gather(units: list[FSDPModule]) -> None:
    """Every rank: the whole weights gathered into each unit, kept through any number of forwards
    (until `release`). Collective; after it, forwards are local."""
    for unit in units:
        unit.unshard()
    for unit in units:
        unit.set_reshard_after_forward(False)


def release(units: list[FSDPModule]) -> None:
    """Drop the gathered copy (local): the shards, untouched by whatever was done to the copy, are
    the weights again. FSDP also forgets the forwards run on the copy: it prefetches in a backward
    by the order of the forwards before it, and rank 0's own would make it gather other units
    than the other ranks (a hang)."""
    root, *rest = units
    for unit in units:
        unit.reshard()
    root.reset_iter_state()
    root.set_reshard_after_forward(False)  # FSDP's defaults: the root keeps its weights gathered
    for unit in rest:                      # from the forward to the backward, the others do not
        unit.set_reshard_after_forward(True)


def full(params: dict[str, torch.nn.Parameter], keep: bool) -> dict[str, torch.Tensor]:
    """Each sharded parameter whole, one at a time, on the CPU (collective: every rank calls it with
    the same names); `keep`: False on ranks that only take part."""
    out = {}
    for name, p in params.items():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        if keep:  # a copy: the caller's numpy view must not pin FSDP's buffers
            out[name] = whole.detach().to("cpu", copy=True)
    return out


@torch.no_grad()
def load_full(params: dict[str, torch.nn.Parameter], weights: dict[str, torch.Tensor] | None) -> None:
    """Rank 0's whole `weights` into every rank's shards, one tensor at a time (collective; the
    other ranks pass None)."""
    for name, p in params.items():
        source = weights[name] if weights is not None else torch.empty(p.shape, dtype=p.dtype)
        shard = distribute_tensor(source.to(device=p.device, dtype=p.dtype), p.device_mesh, p.placements)
        p.to_local().copy_(shard.to_local())


def save_weights(params: dict[str, torch.nn.Parameter], directory: Path) -> None:
    """Every rank's shards of `params` into `directory` (collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(dict(params), checkpoint_id=str(directory), process_group=distributed.group())


def load_weights(params: dict[str, torch.nn.Parameter], directory: Path) -> None:
    """`save_weights`' shards into every rank's `params`, in place (collective)."""
    import torch.distributed.checkpoint as dcp

    with torch.no_grad():
        dcp.load(dict(params), checkpoint_id=str(directory), process_group=distributed.group())


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Weights `save_weights` wrote, whole, in one process with no ranks (export, eval)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    state = {name: torch.empty(m.size, dtype=m.properties.dtype) for name, m in meta.items()}
    with warnings.catch_warnings():  # (that it is one process is the point)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state


def save_optimizer(model: torch.nn.Module, optimizer, directory: Path) -> None:
    """Every rank's shard of the optimiser state into `directory` (collective; the ranks must
    share the filesystem)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(directory),
             process_group=distributed.group())


def load_optimizer(model: torch.nn.Module, optimizer, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory), process_group=distributed.group())
    set_optimizer_state_dict(model, optimizer, state)


def held_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """This rank's parameter and optimiser-state bytes (its shards under FSDP)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    state = sum(local(v).numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    return {"parameters": params, "optimizer": state}
