"""More than one trainer process: data parallelism over the rollout batch on torch.distributed.

Rank 0 is the coordinator: it alone talks to the swarm (leases, the buffer, verification,
publishing, the ledger). The other ranks do nothing but train: for each step rank 0 sends them
the batch, every rank computes the gradient of its share of it (`shares`), the gradients are
summed across ranks, and every rank takes the optimiser step. After each step the ranks compare
the step count and a checksum; a rank that disagrees stops the run (`RanksDisagree`).
- `sharding = "none"`: every rank holds the whole model and optimiser, the gradients are summed
  by one all-reduce (what DDP does, written out because the trainer's forward is not one
  `module(...)` call), and the checksum is of the weights, the same on every rank.
- `sharding = "fsdp"`: each rank holds a shard (`sharded.py`); FSDP sums the gradients into the
  shards, and the checksum is of what each rank was told to train with (the shards differ).
  Rank 0's own uses of the whole weights (publishing, verifying, checkpoints) are collective
  calls the other ranks join (GATHER, WEIGHTS, SAVE, RESUME, VIEW, DELTA).

Processes: `echo-coordinator start --trainer-procs N` starts N - 1 local workers itself (gloo
on the CPU, NCCL on GPUs, loopback only); under `torchrun` every rank runs the same `start`
command and the ones whose RANK is not 0 become workers (docs/scaling.md). Messages between
ranks are msgpack (`samples.encode`) over torch.distributed broadcasts: our own processes, but
still no pickle. A worker rank's loop is `worker.py`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path


from protocols.errors import EchoError

log = logging.getLogger(__name__)

# What rank 0 tells the workers: train on a batch, take rank 0's state (unsharded), stop; and with
# sharding, the collective calls the workers take part in (`worker.py` says what each does).
STEP, LOAD, STOP, GATHER, WEIGHTS, SAVE, RESUME, VIEW, DELTA = 1, 2, 3, 4, 5, 6, 7, 8, 9
JOIN_TIMEOUT = timedelta(minutes=10)  # for every rank to start, load its model and join
# A worker waits for the next batch as long as the swarm takes to bring one; a rank that dies is
# noticed at once (its connections close), not by this timeout.
IDLE_TIMEOUT = timedelta(days=7)
_group = None  # the trainer ranks' process group, with IDLE_TIMEOUT (set by `Ranks.join`)


class DistributedError(EchoError):
    """The trainer processes could not start, or one of them failed."""


class RanksDisagree(DistributedError):
    """After a step the ranks hold different weights or versions."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer processes."""

    rank: int
    world: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Ranks | None:
        """Set by torchrun, or by `start_workers` for local workers; None in a single process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))

    def device(self, requested: str) -> str:
        """This rank's device: with several GPUs on a machine, one each."""
        import torch

        if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
            return "cpu"
        return f"cuda:{self.local_rank}" if requested in ("auto", "cuda") else requested

    def join(self, device: str) -> None:
        """Join the process group (blocks until every rank has)."""
        import torch.distributed as dist

        global _group
        backend = "nccl" if device.startswith("cuda") else "gloo"
        try:
            dist.init_process_group(backend, rank=self.rank, world_size=self.world, timeout=JOIN_TIMEOUT)
            _group = dist.new_group(list(range(self.world)), timeout=IDLE_TIMEOUT)
        except (RuntimeError, ValueError) as e:
            raise DistributedError(f"rank {self.rank} of {self.world} could not join the trainer group "
                                   f"({backend} at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}): {e}")
        log.info("trainer rank %d of %d joined (%s on %s)", self.rank, self.world, backend, device)


def group():
    """The trainer ranks' process group."""
    return _group


def mesh(device_type: str):
    """The trainer ranks as a 1-D device mesh (what FSDP shards over)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(_group, device_type)


def shares(indices: list[int], lengths: list[int], world: int) -> list[list[int]]:
    """Every rank's part of `indices`: longest first, each to the rank with the fewest tokens so
    far, so every rank computes about as much (every rank deals the same way)."""
    loads, parts = [0] * world, [[] for _ in range(world)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        rank = loads.index(min(loads))
        loads[rank] += lengths[i]
        parts[rank].append(i)
    return [sorted(part) for part in parts]


class Channel:
    """Rank 0's commands to the workers: a (command, version, size) header, then the payload."""

    def __init__(self, device: str):
        self.device = device

    def send(self, command: int, version: int = 0, payload: bytes = b"") -> None:
        import torch
        import torch.distributed as dist

        header = torch.tensor([command, version, len(payload)], dtype=torch.long, device=self.device)
        _collective("sending work to the other ranks", dist.broadcast, header, 0)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            _collective("sending work to the other ranks", dist.broadcast, data, 0)

    def receive(self) -> tuple[int, int, bytes]:
        import torch
        import torch.distributed as dist

        header = torch.zeros(3, dtype=torch.long, device=self.device)
        _collective("waiting for rank 0", dist.broadcast, header, 0)
        command, version, size = (int(x) for x in header.tolist())
        payload = b""
        if size:
            data = torch.empty(size, dtype=torch.uint8, device=self.device)
            _collective("receiving work from rank 0", dist.broadcast, data, 0)
            payload = data.cpu().numpy().tobytes()
        return command, version, payload


def _collective(what: str, fn, *args):
    """A collective call on the ranks' group; a rank that died (its connections closed) becomes a
    DistributedError."""
    with collectives(what):
        return fn(*args, group=_group)


@contextmanager
def collectives(what: str) -> Iterator[None]:
    """Collective calls made inside (FSDP's gathers and reductions in a forward and backward):
    a rank that died becomes a DistributedError."""
    try:
        yield
    except RuntimeError as e:
        raise DistributedError(f"the trainer ranks failed while {what}: {e}") from e


def broadcast(tensors: list) -> None:
    """Rank 0's values of `tensors` on every rank."""
    import torch.distributed as dist

    for t in tensors:
        _collective("sending rank 0's weights", dist.broadcast, t.data, 0)


def _params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def sum_gradients(optimizer) -> None:
    """Every rank's gradient replaced by the sum over ranks (one all-reduce of them all, flat)."""
    import torch
    import torch.distributed as dist

    params = _params(optimizer)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    _collective("summing gradients", dist.all_reduce, flat)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def sum_values(values: list[float]) -> list[float]:
    """`values` summed over ranks (float64: integer counts stay exact)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor(values, dtype=torch.float64, device=device)
    _collective("summing step figures", dist.all_reduce, total)
    return total.tolist()


def weights_checksum(optimizer) -> int:
    """A bit-exact checksum of the trainable weights (their bits summed as integers)."""
    import torch

    return sum(int(p.detach().contiguous().view(torch.int16 if p.element_size() == 2 else torch.int32)
                   .sum(dtype=torch.int64)) for p in _params(optimizer))


def digest(text: str) -> int:
    """`text` as a checksum `agree` compares (63 bits of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def agree(steps: int, checksum: int, ranks: Ranks) -> None:
    """Raise RanksDisagree unless every rank has taken `steps` steps with the same `checksum`:
    of the trainable weights when every rank holds them all, of what each rank was told to do
    (its configuration) when each holds other shards."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    low = torch.tensor([steps, checksum], dtype=torch.int64, device=device)
    high = low.clone()
    _collective("comparing weights", dist.all_reduce, low, dist.ReduceOp.MIN)
    _collective("comparing weights", dist.all_reduce, high, dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise RanksDisagree(f"after step {steps} the trainer ranks disagree (rank {ranks.rank}: {steps} steps, "
                            f"checksum {checksum}; over all ranks {low.tolist()} .. {high.tolist()})")


def state_bytes(optimizer) -> bytes:
    """Trainable weights and AdamW state as safetensors bytes (what `load_state_bytes` reads)."""
    from safetensors.torch import save

    tensors = {}
    for i, p in enumerate(_params(optimizer)):
        tensors[f"param.{i}"] = p.detach().cpu().contiguous()
        for key, value in optimizer.state.get(p, {}).items():
            tensors[f"state.{i}.{key}"] = value.detach().cpu().contiguous()
    return save(tensors)


def load_state_bytes(optimizer, payload: bytes) -> None:
    import torch
    from safetensors.torch import load

    tensors = load(payload)
    for i, p in enumerate(_params(optimizer)):
        with torch.no_grad():
            p.copy_(tensors[f"param.{i}"])
        state = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"state.{i}.")}
        if state:
            on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
            optimizer.state[p] = {k: v.to(p.device if (k != "step" or on_device) else "cpu") for k, v in state.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(procs: int, log_of: Callable[[int], Path]) -> list[subprocess.Popen]:
    """`--trainer-procs N` on one machine: this process becomes rank 0 of N, and N - 1 copies of
    this command line become the other ranks (they read the same config), rank r's output in
    `log_of(r)`. Loopback only."""
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(procs), RANK="0",
                      LOCAL_RANK="0", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    workers = []
    for rank in range(1, procs):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        out = open(log_of(rank), "ab")  # noqa: SIM115 (the child owns it)
        workers.append(subprocess.Popen([sys.executable, "-m", "echo_coordinator.cli", *sys.argv[1:]], env=env,
                                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        out.close()
    return workers


def die_with_parent() -> None:
    """A local worker ends when its coordinator does, even one killed with SIGKILL."""
    if sys.platform == "linux" and os.environ.get("MASTER_ADDR") == "127.0.0.1":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
