"""The trainer's weights and state, apart from training them: what a WeightUpdate carries
(`weights`), loading other weights for a while (`holding`: verification against what nodes
held), checkpoints (`save`, `load`), rank 0's state sent to the other ranks, and, sharded, the
collective calls every rank joins to gather, save or publish.

Sharded (FSDP), rank 0 tells the other ranks (`_tell`) before each collective call it makes, and
the worker loop (`worker.py`) makes the same call. In full mode the ranks never gather the weights
onto one rank per step: each update is encoded where the shards live (`shard_delta`), and
checkpoints write every rank's shard of the weights and optimiser state
(torch.distributed.checkpoint); `export` and `eval` read them back whole in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.numpy import load_file

from echo_coordinator.trainer import distributed, shard_delta, sharded
from echo_coordinator.trainer.tensors import save_tensors
from engines.hf import is_tied_head


class TrainerWeights:
    """The half of `Trainer` that reads, writes and moves its weights (the attributes it uses,
    `model`, `optimizer`, `update`, `device`, `ranks`, `sharded`, `units`, `channel`, `steps`,
    are the Trainer's)."""

    @contextmanager
    def holding(self, weights: dict[str, np.ndarray] | None) -> Iterator[None]:
        """Temporarily run with `weights` (a `weights()`-shaped dict: what nodes held at some
        version, the same dict for every lease of that version), then the trainer's own again, bit
        for bit. None: keep the trainer's weights.

        Nothing of the trainer's own is copied (before, every verified lease copied the whole model
        to the host and back): each parameter's storage is swapped for the held version's, kept on
        the device in the compute dtype for as long as leases keep asking for that version (one
        version at a time: a model's worth of device memory). A `frozen` model (the verification
        copy from an HF checkpoint) has no weights of its own to keep: the version goes into its
        parameters and stays there. Sharded, rank 0's forwards inside run on a gathered copy,
        which `weights` go into."""
        if self.sharded:
            self._tell(distributed.GATHER)
            with self._whole():
                if weights is not None:
                    params = self._named()  # the gathered copy's, inside `_whole`
                    with torch.no_grad():
                        for name, value in weights.items():
                            params[name].copy_(torch.from_numpy(value))
                yield
            return
        if weights is None or (self.frozen and self._held[0] is weights):
            yield
            return
        if self.frozen:
            self.load_weights(weights)
            self._held = (weights, None)
            yield
            return
        if self._held[0] is not weights:
            self._held = (None, None)  # the previous version's memory first
            self._held = (weights, self._on_device(weights))
        params, own = self._named(), {}
        try:
            for name, value in self._held[1].items():
                own[name] = params[name].data
                params[name].data = value
            yield
        finally:
            for name, data in own.items():
                params[name].data = data

    def _on_device(self, weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """`weights` as `holding` swaps them in: on the parameters' device, in the dtype forwards
        compute in (full mode's fp32 weights run bf16 matmuls on a GPU, so a held version is bf16
        there: the numbers autocast would make of it). fp32 arrays on the CPU are taken as they are."""
        params = self._named()
        return {name: torch.from_numpy(value).to(device=params[name].device,
                                                 dtype=params[name].dtype if self.update == "lora" else self.compute_dtype)
                for name, value in weights.items()}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        tensors = {k: torch.from_numpy(v).to(self.device) for k, v in weights.items()}
        if self.update == "lora":
            set_peft_model_state_dict(self.model, tensors)
        else:
            self.model.load_state_dict(tensors, strict=False)  # a tied lm_head follows embed_tokens

    def save(self, directory: Path, weights: dict[str, np.ndarray] | None) -> None:
        """`weights` (this step's `weights()`) and optimiser state, so a restarted trainer
        continues the same trajectory. (torch.save is fine here: a local file we wrote, never peer data.)
        Sharded, every rank writes its shard of the optimiser state into `directory/optimizer`, and
        in full mode of the weights into `directory/model` (`weights` unused: None)."""
        directory.mkdir(parents=True, exist_ok=True)
        if not (self.sharded and self.update == "full"):
            save_tensors(weights, directory / "weights.safetensors")
        if self.sharded:
            self._tell(distributed.SAVE, str(directory).encode())
            self.save_shards(directory)
            return
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt.tmp")
        (directory / "optimizer.pt.tmp").replace(directory / "optimizer.pt")

    def load(self, directory: Path) -> None:
        if self.sharded:
            self._tell(distributed.RESUME, str(directory).encode())
            self.load_shards(directory, load_file(str(directory / "weights.safetensors"))
                             if self.update == "lora" else None)
            return
        self.load_weights(load_file(str(directory / "weights.safetensors")))
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True, map_location=self.device))
        if self.ranks is not None:
            self.send_state()

    def save_shards(self, directory: Path) -> None:
        with distributed.collectives("saving a checkpoint"):
            if self.update == "full":
                sharded.save_weights(self._named(), directory / "model")
            sharded.save_optimizer(self.model, self.optimizer, directory / "optimizer")

    def load_shards(self, directory: Path, adapter: dict[str, np.ndarray] | None) -> None:
        """Every rank: its shards of the weights (full mode: saved sharded in `directory`; LoRA:
        rank 0's `adapter`, None on the others) and of the optimiser state."""
        with distributed.collectives("loading a checkpoint"):
            if self.update == "full":
                sharded.load_weights(self._named(), directory / "model")
            else:
                sharded.load_full(self._named(), None if adapter is None else
                                  {k: torch.from_numpy(v) for k, v in adapter.items()})
            sharded.load_optimizer(self.model, self.optimizer, directory / "optimizer")

    def hold_view(self, view: dict[str, np.ndarray] | None) -> None:
        """Sharded full mode: every rank keeps its shard of what nodes hold (`view`: rank 0's
        whole publisher view; None on the others), to encode its part of each update."""
        self._tell(distributed.VIEW)
        with distributed.collectives("dealing out what nodes hold"):
            self.view = shard_delta.ShardView(self._named(), view)

    def topk_delta(self, density: float) -> dict[str, bytes]:
        """Sharded full mode: each weight's topk-int8 update toward the trainer's weights, encoded
        where its shards live (`shard_delta`); every rank gets the payloads, rank 0 publishes them."""
        self._tell(distributed.DELTA, repr(density).encode())
        with distributed.collectives("encoding an update"):
            return self.view.encode(density)

    def _tell(self, command: int, payload: bytes = b"") -> None:
        """Rank 0 of sharded ranks: have the others join the collective call it is about to make."""
        if self.ranks.leader:
            self.channel.send(command, self.steps, payload)

    @contextmanager
    def _whole(self) -> Iterator[None]:
        """Sharded: every rank gathers the whole weights for the block (collective), and its
        forwards inside are its own. Unsharded: nothing to do."""
        if not self.sharded:
            yield
            return
        with distributed.collectives("gathering the weights"):
            sharded.gather(self.units)
        try:
            yield
        finally:
            sharded.release(self.units)

    def _named(self) -> dict[str, torch.nn.Parameter]:
        """The parameters `weights()` carries, under its names: the adapter's (peft's names
        drop the adapter's), or every distinct weight (a tied head is the embeddings)."""
        if self.update == "lora":
            return {n.replace(".default", ""): p for n, p in self.model.named_parameters() if p.requires_grad}
        return dict(self.model.named_parameters())

    def send_state(self) -> None:
        """Rank 0: give every other rank these weights, optimiser state and step count."""
        self.channel.send(distributed.LOAD, self.steps, distributed.state_bytes(self.optimizer))

    def receive_state(self, steps: int, payload: bytes) -> None:
        """The other ranks: take rank 0's weights, optimiser state and step count."""
        distributed.load_state_bytes(self.optimizer, payload)
        self.steps = steps

    def weights(self) -> dict[str, np.ndarray]:
        """What a WeightUpdate carries, as float32 arrays: the LoRA adapter under peft's names
        (`...q_proj.lora_A.weight`), or in full mode every distinct weight under HF names. Sharded,
        every rank takes part and rank 0 gets them (the others an empty dict)."""
        if self.sharded:
            self._tell(distributed.WEIGHTS)
            with distributed.collectives("gathering the weights"):
                state = sharded.full(self._named(), keep=self.ranks.leader)
        elif self.update == "lora":
            state = get_peft_model_state_dict(self.model)
        else:
            state = {k: v for k, v in self.model.state_dict().items() if not is_tied_head(self.model.config, k)}
        return {name: t.detach().float().cpu().numpy().copy() for name, t in state.items()}
