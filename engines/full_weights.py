"""Full-parameter mode on a llama.cpp node: the float32 master weights an update applies to,
re-exported as GGUF.

Every node starts from its base GGUF dequantized by transformers (`hf.load_master`), and applies
each update with `protocols.delta.apply`, the function the trainer's publisher used to advance
its view. When the run's base is that GGUF (the trainer loads it the same way), the master
weights equal the publisher's view bit for bit after every version. When the trainer trains an
HF checkpoint, the node's base is its quantization, and the master weights stay that quantized
base plus exactly the changes the publisher sent (its view minus the trainer's base): the
quantization error is the node's, and the trainer's TIS corrects for it like any other mismatch.
A llama.cpp node re-exports the master weights to GGUF and requantizes to the quant type it
joined with; the old model keeps serving until the new one has loaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.gguf_io import FILE_TYPES, quantize, write_model


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
