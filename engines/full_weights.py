"""Full-parameter mode: the float32 master weights an update applies to, re-exported as GGUF, and
what a node holds once it loaded them.

Every node starts from its base GGUF dequantized by transformers (`hf.load_master`), and applies
each update with `protocols.delta.apply`, the function the trainer's publisher used to advance
its view. When the run's base is that GGUF (the trainer loads it the same way), the master
weights equal the publisher's view bit for bit after every version. When the trainer trains an
HF checkpoint, the node's base is its quantization, and the master weights stay that quantized
base plus exactly the changes the publisher sent (its view minus the trainer's base): the
quantization error is the node's, and the trainer's TIS corrects for it like any other mismatch.
A llama.cpp node re-exports the master weights to GGUF and requantizes to the quant type it
joined with; the old model keeps serving until the new one has loaded.

So from version 1 on a node samples with neither its base nor its master weights but with their
requantization (`requantized`): a small change rounds back to the base's grid, a larger one
moves to the next point. The verifier checks against that, and a transformers node loads it
too, so every honest node of a run holds the same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.gguf_io import FILE_TYPES, quantize, read_model, write_model
from engines.gguf_read import read_field


def file_type(model: Path) -> int:
    """The quant type a node requantizes to: its joined model's `general.file_type` (f32 if unset)."""
    return int(read_field(model, "general.file_type") or FILE_TYPES["f32"])


def export_quantized(config, master: dict[str, np.ndarray], tokenizer_from: Path, out: Path, ftype: int) -> Path:
    """Write the master weights as GGUF, requantized to `ftype` (the joined model's file type)."""
    f32 = out.with_name(out.stem + ".f32.gguf")
    write_model(config, master, f32, tokenizer=tokenizer_from)
    if ftype == FILE_TYPES["f32"]:
        return f32.replace(out)
    try:
        return quantize(f32, out, ftype)
    finally:
        f32.unlink(missing_ok=True)


def requantized(config, master: dict[str, np.ndarray], tokenizer_from: Path, out: Path,
                ftype: int) -> dict[str, np.ndarray]:
    """What a node holds once it loaded `master`: `export_quantized`'s file (written at `out`,
    removed after) dequantized back to float32 under the master's names. New arrays. An f32
    export is the master weights exactly, so it is not written."""
    if ftype == FILE_TYPES["f32"]:
        return {name: np.array(value, dtype=np.float32) for name, value in master.items()}
    try:
        return read_model(export_quantized(config, master, tokenizer_from, out, ftype), config, master)
    finally:
        out.unlink(missing_ok=True)
