"""Will the trainer fit? At start, before any weights load, `memory_plan`'s bytes per rank against
this machine's device: a trainer that cannot fit is refused with what would (more ranks,
activation checkpointing, LoRA, a larger device), each suggestion checked with the same arithmetic."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from echo_coordinator.memory_plan import KNOWN_TYPES, ModelShape, Plan, Setup, gib, needed, plan
from protocols.errors import ConfigError

log = logging.getLogger(__name__)

SHARDINGS = (2, 4, 8, 16, 32, 64, 128)  # rank counts the refusal tries for sharding = "fsdp"
# A change is suggested only if it leaves this share of the device for what the estimate leaves
# out (CUDA context, fragmentation, workspaces): the refusal itself needs no margin, the advice does.
ADVICE_SHARE = 0.9


class MemoryPlanError(ConfigError):
    """The trainer cannot fit in this machine's memory as configured; the message says what would."""


@dataclass(frozen=True)
class Machine:
    kind: str  # "cuda" or "cpu"
    name: str
    memory: int  # bytes of one GPU, or of the machine's RAM
    gpus: int  # on this machine (0: the CPU)


def refusal(shape: ModelShape, setup: Setup, machine: Machine, local_ranks: int) -> str | None:
    """Why the trainer cannot fit, with what would, or None. On GPUs each local rank has its own
    (every machine taken to be like this one); on the CPU the local ranks share the machine's RAM."""
    if machine.kind == "cuda" and local_ranks > machine.gpus:
        return (f"{local_ranks} trainer processes on this machine need {local_ranks} GPUs, it has {machine.gpus}: "
                f"set [trainer] procs to at most {machine.gpus}, or spread the ranks over machines with torchrun")
    sharing = local_ranks if machine.kind == "cpu" else 1
    need = needed(shape, setup, sharing)
    if need <= machine.memory:
        return None
    where = (f"{machine.name} ({gib(machine.memory)})" if machine.kind == "cuda"
             else f"this machine's RAM ({gib(machine.memory)}, shared by {local_ranks} trainer processes)")
    return (f"the trainer needs about {gib(need)} of {where} at its peak: {plan(shape, setup).parts()} "
            f"({shape.parameters() / 1e9:.2f} B parameters, update {setup.update!r}, sharding {setup.sharding!r} "
            f"over {setup.ranks} rank(s), micro-batches of up to {setup.tokens} tokens). "
            + fixes(shape, setup, machine, sharing))


def fixes(shape: ModelShape, setup: Setup, machine: Machine, sharing: int) -> str:
    """The changes that would make it fit with room to spare, each checked with the same arithmetic."""
    room = ADVICE_SHARE * machine.memory
    out = []
    if machine.kind == "cuda":
        for checkpointing in sorted({setup.checkpointing, True}):  # as set first, then with it
            trial = replace(setup, checkpointing=checkpointing, sharding="fsdp")
            ranks = next((n for n in SHARDINGS if n > (setup.ranks if setup.sharding == "fsdp" else 1)
                          and needed(shape, replace(trial, ranks=n)) <= room), None)
            if ranks:
                where = f"{ranks} GPUs" + ("" if ranks <= machine.gpus else " (machines like this one, torchrun)")
                also = " and activation_checkpointing = true" if checkpointing != setup.checkpointing else ""
                out.append(f'sharding = "fsdp" over {where}{also} '
                           f"({gib(needed(shape, replace(trial, ranks=ranks)))} on rank 0)")
                break
        else:
            copy = plan(shape, setup).verification
            if copy:
                out.append(f"no number of ranks fits rank 0 here: its verification copy of the model alone is "
                           f"{gib(copy)} (not sharded); a GGUF base has none (the trainer verifies with its "
                           "own weights)")
    for change, text in ((dict(checkpointing=True), "activation_checkpointing = true"),
                         (dict(update="lora"), '[run] update = "lora"')):
        trial = replace(setup, **change)
        if trial != setup and needed(shape, trial, sharing) <= room:
            out.append(f"{text} ({gib(needed(shape, trial, sharing))})")
    out.append(f"a device with at least {gib(needed(shape, setup, sharing))}")
    return "To fit: " + "; or ".join(out) + "."


def check_start(model: Path, run, trainer, multi_turn: bool) -> Plan | None:
    """At start, before any weights load: raise MemoryPlanError if this machine cannot hold the
    trainer `run` and `trainer` (the configs) describe. Skipped, with a log line, where the model's
    shape is not at hand: a GGUF base, or a config.json of an architecture not known here."""
    from echo_coordinator.trainer.distributed import Ranks  # torch-free at import
    from engines.episodes import context_window

    config = model / "config.json"
    if not config.is_file():
        log.info("memory check skipped: %s has no config.json (a GGUF base)", model.name)
        return None
    shape = ModelShape.from_config(json.loads(config.read_text()))
    if shape is None:
        log.info("memory check skipped: %s is not one of %s", model.name, ", ".join(KNOWN_TYPES))
        return None
    ranks = Ranks.from_env()
    world = ranks.world if ranks else trainer.procs
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if ranks else trainer.procs
    machine = this_machine(trainer.device, ranks.local_rank if ranks else 0)
    if machine is None:
        log.info("memory check skipped: device %s is not available here", trainer.device)
        return None
    setup = Setup(update=run.update, lora_rank=trainer.lora_rank, sharding=trainer.sharding, ranks=world,
                  weight_bytes=2 if machine.kind == "cuda" else 4,
                  tokens=max(trainer.micro_batch_tokens, context_window(run.max_new_tokens, multi_turn)),
                  # an HF checkpoint: rank 0 also loads the nodes' GGUF to verify with
                  checkpointing=trainer.activation_checkpointing, verification_copy=True,
                  gathers_whole=trainer.ppo_epochs * trainer.ppo_minibatches > 1)
    reason = refusal(shape, setup, machine, local)
    if reason is not None:
        raise MemoryPlanError(reason)
    p = plan(shape, setup)
    log.info("memory: the trainer needs about %s on rank 0 (%s) of %s", gib(p.rank0), p.parts(), gib(machine.memory))
    return p


def this_machine(requested: str, local_rank: int) -> Machine | None:
    """The device a trainer rank of this machine gets (as `Ranks.device` and the learner choose it)."""
    import torch

    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return Machine("cpu", "CPU", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 0)
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(int(requested.partition(":")[2] or local_rank))
    return Machine("cuda", props.name, props.total_memory, torch.cuda.device_count())
