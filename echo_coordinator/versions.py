"""Publishing versions: the signed update(s) into each new version, what nodes hold at it (which
the verifier checks their batches against), the LoRA adapters saved for `eval` and `export`,
the trainer's checkpoint, and the evaluation round a version opens.

Called on the torch thread (these export and compare weights), except at start-up, before any
handler runs. A version is made current (`serve`) only once its step is on disk: nodes never
hear of a version that a restart could lose (the order is in `steps.py`).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import numpy as np

from echo_coordinator import publish
from echo_coordinator.config import RunConfig
from echo_coordinator.evaluation import due
from echo_coordinator.run_dir import RunDir
from echo_coordinator.service import RunService
from echo_coordinator.verify import NodesHold, Verifier, lora_base
from engines.full_weights import file_type, requantized
from protocols.messages import RunManifest

log = logging.getLogger(__name__)

Weights = dict[str, np.ndarray]


class Versions:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, key, manifest: RunManifest, verifier: Verifier,
                 trainer, checker, node_gguf: Path, resumed_from=None):
        """`checker`: the model verification runs (the trainer itself, or from an HF checkpoint a copy
        loaded from the nodes' GGUF). `node_gguf`: that GGUF, whose file type full-mode nodes
        requantize every version to. `resumed_from`: a restart's checkpoint, whose saved view of
        what nodes hold the publisher takes up. LoRA nodes start with no adapter; full-mode nodes
        with the base weights."""
        from safetensors.numpy import load_file

        self.cfg, self.dir, self.manifest, self.verifier = cfg, run_dir, manifest, verifier
        self.trainer, self.checker = trainer, checker
        view = load_file(str(run_dir.view_of(resumed_from))) if resumed_from is not None else None
        self.nodes_hold: NodesHold | None = None  # full mode: what nodes hold, given the publisher's view
        if cfg.update == "lora":
            self.publisher = publish.Publisher(manifest.run_id, key, "lora", view, cfg.lora_encoding, cfg.update_density,
                                               cfg.snapshot_every, dict(manifest.update_params))
        else:
            # The checker was loaded from the nodes' GGUF: its config is the one they re-export with.
            requantize = functools.partial(requantized, checker.causal.config, tokenizer_from=node_gguf,
                                           out=run_dir.held_model, ftype=file_type(node_gguf))
            self.nodes_hold = (NodesHold(requantize) if checker is trainer else
                               NodesHold(requantize, trainer.weights(), checker.weights()))
            self.publisher = publish.Publisher(manifest.run_id, key, "full", trainer.weights() if view is None else view,
                                               cfg.update_encoding, cfg.update_density, cfg.snapshot_every)
        # Sharded full mode: each update is encoded where the trainer's shards live, never
        # gathering the weights onto rank 0 (dense encodings are the weights' size: they gather).
        self.local_delta = trainer.sharded and cfg.update == "full" and cfg.update_encoding == "topk-int8"
        if self.local_delta:
            trainer.hold_view(self.publisher.view())

    def step_weights(self) -> Weights | None:
        """The trainer's weights after a step, for `build_updates` and the checkpoint; None where
        the trainer's ranks encode the update and save the weights where their shards live."""
        return None if self.local_delta else self.trainer.weights()

    def begin(self, service: RunService) -> None:
        """A new run: at version 0 nodes hold the base model."""
        held = lora_base(self.trainer.weights()) if self.cfg.update == "lora" else self.checker.weights()
        self.verifier.remember(0, held)
        self.open_eval(service, 0, held)

    def resume(self, service: RunService) -> None:
        """After a restart (the trainer loaded from its checkpoint): the current version again."""
        version = service.version
        self.remember_held(version)
        published, held = self.build_updates(version, None, resumed=True)
        self.serve(service, version, published, held)

    def build_updates(self, version: int, weights: Weights | None, resumed: bool = False):
        """The signed update(s) into `version` and what nodes will hold at it; `weights`: the
        trainer's `step_weights()` (exported once, shared with the checkpoint)."""
        from echo_coordinator.trainer.tensors import save_tensors

        if resumed:
            # The delta into this version died with the old process; a snapshot serves everyone.
            published = [self.publisher.snapshot(version)]
        elif self.local_delta:
            published = self.publisher.publish(version, None, self.trainer.topk_delta(self.cfg.update_density))
        else:
            published = self.publisher.publish(version, weights)
        if self.nodes_hold is not None:
            started = time.perf_counter()
            held = self.nodes_hold(self.publisher.view())
            log.info("what nodes hold at version %d, requantized, in %.2f s", version, time.perf_counter() - started)
            return published, held
        # LoRA: the trained adapter (what `eval` and `export` read), and what nodes hold (what a
        # restart verifies older batches with, for the versions the bound admits).
        held = self.publisher.view()
        if not resumed:
            save_tensors(weights, self.dir.adapter(version))
        save_tensors(held, self.dir.adapter(version, held=True))
        self.dir.adapter(version - self.verifier.keep_versions - 1, held=True).unlink(missing_ok=True)
        return published, held

    def save_checkpoint(self, version: int, weights: Weights) -> None:
        """The trainer and the publisher's view into `checkpoints/v{version}`; the previous one
        stays whole until `state.json` names this one."""
        self.dir.save_checkpoint(version, self.trainer, weights, self.publisher.view())

    def serve(self, service: RunService, version: int, published, held: Weights) -> None:
        """Make `version` current: nodes hear of it from here on."""
        self.verifier.remember(version, held)  # before nodes can hear of the version
        service.publish(published)
        self.open_eval(service, version, held)

    def open_eval(self, service: RunService, version: int, held: Weights) -> None:
        if service.evaluation is not None and due(version, self.cfg.eval_every, self.cfg.steps):
            service.open_eval(version, held)

    def remember_held(self, version: int) -> None:
        """After a restart, what nodes held at the versions before `version` that the bound still
        admits, so their batches stay verifiable: LoRA keeps them on disk. (Full mode keeps only
        the current view; older batches are refused as `unverifiable`, the nodes' work lost once.)"""
        if self.cfg.update != "lora":
            return
        from safetensors.numpy import load_file

        for v in range(max(0, version - self.verifier.keep_versions), version):
            path = self.dir.adapter(v, held=True)
            if v == 0:
                self.verifier.remember(0, lora_base(self.trainer.weights()))
            elif path.exists():
                self.verifier.remember(v, load_file(str(path)))
