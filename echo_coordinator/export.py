"""`echo-coordinator export`: the trained policy out of the swarm, as an HF checkpoint (the LoRA
adapter merged into the base, or the full weights) and optionally as a GGUF made by the same
converter the coordinator uses for its nodes. It reads the run directory only; the coordinator
need not be running."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from echo_coordinator.base_model import convert
from echo_coordinator.local_eval import weights_of
from echo_coordinator.run_dir import RunDir
from protocols.errors import EchoError


def export(data_dir: Path, out: Path, version: int, gguf: str | None = None, say=print) -> list[Path]:
    """Write version `version` of the run in `data_dir` to `out`; returns the files written."""
    import torch
    from transformers import AutoModelForCausalLM

    from echo_coordinator.trainer.learner import Trainer

    run_dir = RunDir(data_dir)
    run, tcfg = run_dir.read_config()
    started = time.perf_counter()
    # On the CPU in fp32: the merge is exact there, and a GPU trainer's bf16 would round it.
    trainer = Trainer(run_dir.base_source(), replace(tcfg, device="cpu"), run.temperature, run.seed, run.update)
    trainer.load_weights(weights_of(run_dir, run, trainer, version))
    model = trainer.model.merge_and_unload() if run.update == "lora" else trainer.model
    # A fresh model of the same config: one loaded from a GGUF is marked quantized, which
    # transformers refuses to save, though its weights are plain dequantized floats.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    trainer.tokenizer.save_pretrained(out)
    say(f"wrote version {version} as an HF checkpoint to {out} ({time.perf_counter() - started:.1f} s)")
    written = sorted(out.iterdir())
    if gguf:
        path = out / f"{out.name}-v{version}-{gguf}.gguf"
        try:
            convert(out, path, gguf)
        except EchoError as e:
            raise EchoError(f"the HF checkpoint is written, the GGUF is not: {e}") from None
        say(f"wrote {path.name} ({path.stat().st_size / 1e6:.1f} MB)")
        written.append(path)
    return written
