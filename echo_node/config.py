"""A node's configuration, checked when it is made, and the errors that end a node on purpose."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from echo_node.schedule import Hours
from engines.llama_device import KV_TYPES
from protocols.errors import ConfigError, EchoError
from protocols.messages.work import MAX_PARALLEL
from protocols.multiaddr import peer_of
from protocols.signing import FINGERPRINT_CHARS

BACKENDS = ("llama_cpp", "transformers")


class JoinRefused(EchoError):
    """The run cannot be joined: wrong key, wrong base model, or not found."""


class Stopped(EchoError):
    """Ctrl-C arrived during generation (the unfinished batch is dropped, its lease expires) or
    before the node could start (a base model download resumes on the next join)."""


@dataclass(frozen=True)
class NodeConfig:
    address: str  # coordinator multiaddr from the join line
    run_key: str  # pinned run-key fingerprint
    model: Path | None = None  # this node's copy of the base model GGUF; None: fetch it from the swarm
    name: str | None = None  # public display name
    data_dir: Path = Path("~/.echo-node")  # node key, adapters, cached base models
    threads: int = 0  # generation threads; 0 = all cores
    backend: str = "llama_cpp"  # "llama_cpp" (GGUF, any machine) or "transformers" (full mode, CUDA if present)
    gpu_layers: int | None = None  # llama.cpp layers to offload; None: all when llama.cpp has a GPU backend
    hours: str | None = None  # local hours the node works, "22-07" (echo_node.schedule); None: always
    max_vram_gib: float | None = None  # device memory llama.cpp may take; None: as much as the model needs
    kv: str | None = None  # llama.cpp's KV cache type, f32 or f16; None: the first that runs here (engines.llama_device)
    parallel: int | None = None  # sequences decoded at once; None: the backend's default (llama.cpp: 8)
    cpu_moe: bool = False  # a mixture of experts' expert tensors stay in system RAM (llama.cpp) ...
    n_cpu_moe: int = 0  # ... or those of the first N layers
    # llama.cpp runs in a worker process confined to the model and the node's adapters and exports
    # (engines.sandbox); False: unconfined, for a system where the sandbox keeps a GPU backend from working.
    sandbox: bool = True
    host: str | None = None  # listen address; None: loopback for a coordinator on loopback, else every interface
    verbose: bool = False  # a line per lease and update, and INFO logs, instead of one live status line
    # Environments named as `module:Class` this node may import and run (importing runs the
    # module's code, so a coordinator alone cannot choose it); built-in and installed ones need not be.
    allow_tasks: frozenset[str] = frozenset()
    # What this node uploads to peers (the base model and updates it relays), in all: anyone may
    # ask, under any number of peer ids. MiB a second on average, and GiB in any hour.
    upload_mib_per_s: float = 8.0
    upload_gib_per_hour: float = 4.0
    # GiB the data dir may hold (cached base models, adapters, full-mode exports): whatever sizes a
    # coordinator states, the node writes no more (`echo_node.disk`). None: the disk's free space.
    max_disk_gib: float | None = 100.0

    def __post_init__(self):
        try:
            peer_of(self.address)
        except ValueError:
            raise ConfigError(f"the coordinator address must be the multiaddr from the join line, ending in "
                              f"/p2p/<peer id>; got {self.address!r}") from None
        if len(self.run_key) != FINGERPRINT_CHARS or not self.run_key.isalnum():
            raise ConfigError(f"--run-key must be the {FINGERPRINT_CHARS}-character fingerprint the coordinator "
                              f"printed; got {self.run_key!r}")
        if self.parallel is not None and not 1 <= self.parallel <= MAX_PARALLEL:
            raise ConfigError(f"--parallel must be between 1 and {MAX_PARALLEL}, got {self.parallel}")
        if not (self.upload_mib_per_s > 0 and self.upload_gib_per_hour > 0):
            raise ConfigError("--upload-mib-per-s and --upload-gib-per-hour must be positive")
        if self.max_disk_gib is not None and not self.max_disk_gib > 0:
            raise ConfigError(f"--max-disk must be a positive number of GiB, got {self.max_disk_gib}")
        if self.n_cpu_moe < 0 or (self.cpu_moe and self.n_cpu_moe):
            raise ConfigError("--n-cpu-moe must be a number of layers >= 0, and not given with --cpu-moe")
        if (self.max_vram_gib is not None or self.kv) and self.backend != "llama_cpp":
            raise ConfigError("--max-vram and --kv set up llama.cpp: use the llama_cpp backend")
        if (self.cpu_moe or self.n_cpu_moe) and self.backend != "llama_cpp":
            raise ConfigError("--cpu-moe and --n-cpu-moe place llama.cpp's expert tensors: use the llama_cpp backend")
        if self.hours is not None:
            try:
                Hours.parse(self.hours)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.max_vram_gib is not None and not self.max_vram_gib > 0:
            raise ConfigError(f"--max-vram must be a positive number of GiB, got {self.max_vram_gib}")
        if self.kv is not None and self.kv not in KV_TYPES:
            raise ConfigError(f"--kv must be one of {', '.join(KV_TYPES)}, got {self.kv!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be llama_cpp or transformers, got {self.backend!r}")
