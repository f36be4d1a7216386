"""The run directory (`data_dir`): the one place that knows its file layout.

    state.json            the version a restart resumes at, and its checkpoint (replaced atomically:
                          a step is done once this file names its version)
    checkpoints/vN/       the trainer (weights, optimiser) and the publisher's view of what nodes hold
                          at version N; only the one state.json names is kept
    adapters/vN.safetensors       LoRA: the adapter trained into version N (`eval`, `export` read it)
    adapters/vN.held.safetensors  LoRA: what nodes hold at N (verifies their older batches after a restart)
    config.json           the run's RunConfig and TrainerConfig (`eval`, `export` read them back)
    base.json             where the trainer's base model came from (`eval`, `export`)
    models/               the nodes' GGUFs made from HF checkpoints, cached by content hash
    held.gguf             full mode: what nodes hold at a new version, while it is read back (then removed)
    run.key, p2p.id       the run's signing key; the libp2p identity (a stable address across restarts)
    join.txt              the `echo-node join` line; dashboard.txt: the dashboard's URL while it serves
    ledger.sqlite         contributions, the run's identity and version, the journal
    metrics.jsonl         a line per step and per evaluation; transcripts.jsonl: each step's best and worst sample
    trainer-rankN.log     output of the local trainer ranks; NAME.log and NAME/: a demo's processes
    curves.png            `echo-coordinator plot`'s default output
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_coordinator.config import RunConfig, TrainerConfig, from_tables, to_tables
from protocols.errors import EchoError

if TYPE_CHECKING:
    from echo_coordinator.base_model import BaseModel


class RunDirError(EchoError):
    """The run directory lacks a file a command needs, or holds one that cannot be read."""


@dataclass(frozen=True)
class RunState:
    """What `state.json` says: the version to resume at and what resuming needs."""

    run_id: str
    version: int
    checkpoint: Path | None  # the trainer's checkpoint of `version`; None at version 0
    service: dict[str, Any]  # RunService.state(): the gate and the journal's position


class RunDir:
    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser()
        self.state_file = self.root / "state.json"
        self.checkpoints = self.root / "checkpoints"
        self.adapters = self.root / "adapters"
        self.config_file = self.root / "config.json"
        self.base_file = self.root / "base.json"
        self.models = self.root / "models"
        self.held_model = self.root / "held.gguf"
        self.run_key = self.root / "run.key"
        self.p2p_id = self.root / "p2p.id"
        self.join_file = self.root / "join.txt"
        self.dashboard_file = self.root / "dashboard.txt"
        self.ledger = self.root / "ledger.sqlite"
        self.metrics = self.root / "metrics.jsonl"
        self.transcripts = self.root / "transcripts.jsonl"
        self.curves = self.root / "curves.png"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.adapters.mkdir(exist_ok=True)

    def checkpoint(self, version: int) -> Path:
        return self.checkpoints / f"v{version}"

    def adapter(self, version: int, held: bool = False) -> Path:
        """LoRA: the adapter trained into `version`, or (`held`) what nodes hold at it."""
        return self.adapters / f"v{version}{'.held' if held else ''}.safetensors"

    def adapter_versions(self) -> list[int]:
        """The versions whose trained adapter is saved (version 0, the base, has none)."""
        names = (p.name.removesuffix(".safetensors") for p in self.adapters.glob("v*.safetensors"))
        return sorted(int(n[1:]) for n in names if n[1:].isdigit())

    def trainer_log(self, rank: int) -> Path:
        return self.log(f"trainer-rank{rank}")

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def node_dir(self, name: str) -> Path:
        """A demo's local node's own data directory."""
        return self.root / name

    def write_join(self, line: str) -> None:
        """The join line, whole or not at all: whoever sees `join.txt` can use it."""
        _replace(self.join_file, line + "\n")

    def load_state(self) -> RunState | None:
        """What `state.json` names; None before a run's first start."""
        if not self.state_file.exists():
            return None
        try:
            raw = json.loads(self.state_file.read_text())
            checkpoint = self.root / raw["checkpoint"] if raw["checkpoint"] else None
            return RunState(raw["run_id"], int(raw["version"]), checkpoint, raw["service"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise RunDirError(f"cannot read {self.state_file}: {e}") from None

    def write_state(self, run_id: str, version: int, service: dict[str, Any]) -> None:
        """Name `version` (and its checkpoint) as the one to resume at: an atomic replace. Older
        checkpoints, and any a crash left half-written, go."""
        checkpoint = f"checkpoints/v{version}" if version else None
        _replace(self.state_file, json.dumps({"run_id": run_id, "version": version, "checkpoint": checkpoint,
                                              "service": service}))
        for old in self.checkpoints.glob("v*"):
            if f"checkpoints/{old.name}" != checkpoint:
                shutil.rmtree(old, ignore_errors=True)

    def save_checkpoint(self, version: int, trainer, weights: dict, view: dict) -> None:
        """The trainer (weights, optimiser) and the publisher's view of what nodes hold, into a
        directory of their own: the previous checkpoint stays whole until `state.json` names this one."""
        from echo_coordinator.trainer.tensors import save_tensors

        directory = self.checkpoint(version)
        trainer.save(directory, weights)
        save_tensors(view, directory / "view.safetensors")

    @staticmethod
    def view_of(checkpoint: Path) -> Path:
        """The publisher's view saved with a checkpoint."""
        return checkpoint / "view.safetensors"

    @staticmethod
    def weights_of(checkpoint: Path) -> dict:
        """The trainer's weights saved with a checkpoint (`Trainer.save` writes them: whole, or
        sharded by a sharded full-mode trainer's ranks), as float32 arrays."""
        from safetensors.numpy import load_file

        if (checkpoint / "weights.safetensors").exists():
            return load_file(str(checkpoint / "weights.safetensors"))
        from echo_coordinator.trainer.sharded import read_weights

        return {name: t.float().numpy() for name, t in read_weights(checkpoint / "model").items()}

    def write_config(self, run: RunConfig, trainer: TrainerConfig) -> None:
        """What `echo-coordinator eval` and `export` read back."""
        self.config_file.write_text(json.dumps(to_tables(run, trainer), indent=1))

    def read_config(self) -> tuple[RunConfig, TrainerConfig]:
        """The run's configuration, as strictly as run.toml: an unknown field is refused by name."""
        if not self.config_file.exists():
            raise RunDirError(f"no run configuration in {self.root} (missing config.json; runs started before "
                              f"evaluation existed do not have one)")
        try:
            raw = json.loads(self.config_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunDirError(f"cannot read {self.config_file}: {e}") from None
        if not isinstance(raw, dict):
            raise RunDirError(f"{self.config_file} is not a JSON object")
        return from_tables(raw, self.config_file)

    def record_base(self, base: BaseModel) -> None:
        """Where the trainer's model came from, for `eval` and `export` (which run without the coordinator)."""
        self.base_file.write_text(json.dumps({"source": str(base.source), "node_gguf": str(base.node_gguf),
                                              "arch": base.arch}))

    def base_source(self) -> Path:
        try:
            return Path(json.loads(self.base_file.read_text())["source"])
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise RunDirError(f"{self.root} has no readable base.json (was a run started there?): {e}") from None


def _replace(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file, then an atomic rename over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
