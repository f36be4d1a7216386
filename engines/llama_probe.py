"""Where and how the node runs llama.cpp: each candidate setting fitted to the volunteer's device
memory and tried in a throwaway process, so that a backend that crashes (a CUDA build died at its
first decode with an fp32 KV cache) costs a probe, not the node.

    python -P -m engines.llama_probe MODEL --gpu-layers N --parallel P --window W --kv f32 [--flash-attn]
        [--no-sandbox]

loads the model as the node would, decodes one step for every sequence and prints a JSON line;
`place` fits each candidate (`llama_device.candidates`) and keeps the first whose probe works.
The probe opens the coordinator's file, so it is confined as the worker is (`engines.sandbox`,
failing closed) unless the node runs with `--no-sandbox`; `-P` keeps the directory it runs in
(the worker's, `/`) off its import path.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engines import llama_device
from engines.llama_device import ContextSettings, DeviceError
from engines.sandbox import SandboxError, confine

PROBE_SECONDS = 600.0  # a big model's first load from a cold disk


@dataclass(frozen=True)
class Placement:
    settings: ContextSettings
    gpu_layers: int
    parallel: int
    fitted: str | None = None  # what --max-vram chose, said for the volunteer


def place(model: Path, gpu: bool, gpu_layers: int, parallel: int, window: int, kv: str | None = None,
          max_vram_gib: float | None = None, timeout: float = PROBE_SECONDS, sandbox: bool = True) -> Placement:
    """The node's settings, layers on the GPU and sequences at once. Each candidate is fitted to
    `max_vram_gib` on its own (an fp16 cache takes half the fp32's); on a GPU the first whose probe
    decodes is kept. A budget that holds no layer leaves the model on the CPU, with the CPU's settings.
    `sandbox`: whether probes are confined (False: the node's --no-sandbox)."""
    if gpu and gpu_layers != 0:
        sizes = None if max_vram_gib is None else llama_device.model_sizes(model)  # seconds for a big vocabulary
        tries = [Placement(s, gpu_layers, parallel) if sizes is None else
                 Placement(s, *llama_device.within(sizes, max_vram_gib, gpu_layers, parallel, window, s))
                 for s in llama_device.candidates(True, kv)]
        if tries[0].gpu_layers != 0:
            return choose(model, window, tries, timeout, sandbox)
        gpu_layers, parallel, fitted = tries[0].gpu_layers, tries[0].parallel, tries[0].fitted
    else:
        fitted = None if max_vram_gib is None else "--max-vram has no effect: the model runs on the CPU"
    return Placement(llama_device.candidates(False, kv)[0], gpu_layers, parallel, fitted)


def choose(model: Path, window: int, tries: list[Placement], timeout: float = PROBE_SECONDS,
           sandbox: bool = True) -> Placement:
    """The first of `tries` that loads and decodes in a probe process; a DeviceError that says
    what each one did, and what to try, when none does (a SandboxError when a probe could not be
    confined: no setting would be)."""
    failures = []
    for t in tries:
        failure = probe(model, t.gpu_layers, t.parallel, window, t.settings, timeout, sandbox)
        if failure is None:
            return t
        failures.append(f"{t.settings}: {failure}")
    gpu_layers = tries[0].gpu_layers
    raise DeviceError(f"llama.cpp could not decode on this GPU with {gpu_layers if gpu_layers >= 0 else 'all'} "
                      f"layers offloaded ({'; '.join(failures)}). Try fewer sequences (--parallel), "
                      f"fewer layers (--gpu-layers), or the CPU (--gpu-layers 0); docs/volunteers.md lists the "
                      f"builds that were run on each GPU family.")


def probe(model: Path, gpu_layers: int, parallel: int, window: int, settings: ContextSettings,
          timeout: float = PROBE_SECONDS, sandbox: bool = True) -> str | None:
    """None when a process could load `model` and decode with `settings`; else what went wrong."""
    command = probe_command(model, gpu_layers, parallel, window, settings) + ([] if sandbox else ["--no-sandbox"])
    try:
        # One BLAS thread: a thread running before `confine` makes it refuse (Landlock would miss it).
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        return f"no answer in {timeout:.0f} s"
    if done.returncode < 0:
        return f"llama.cpp crashed ({signal.Signals(-done.returncode).name})"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"exit code {done.returncode}: {tail[:300]}"
    answer = json.loads(lines[-1])
    if answer.get("sandbox"):
        raise SandboxError(str(answer["sandbox"]))  # (its whole message: why, and --no-sandbox)
    return None if answer.get("ok") else answer.get("error", "no answer")


def probe_command(model: Path, gpu_layers: int, parallel: int, window: int, settings: ContextSettings) -> list[str]:
    return [sys.executable, "-P", "-m", "engines.llama_probe", str(model), "--gpu-layers", str(gpu_layers),
            "--parallel", str(parallel), "--window", str(window), "--kv", settings.kv] + (
        ["--flash-attn"] if settings.flash_attn else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--gpu-layers", type=int, default=-1)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--kv", default="f32")
    parser.add_argument("--flash-attn", action="store_true")
    parser.add_argument("--no-sandbox", action="store_true", help="unconfined: the node's --no-sandbox")
    args = parser.parse_args()

    import llama_cpp
    import numpy as np

    from engines.llama_batch import BatchContext, DecodeError

    if not args.no_sandbox:
        try:  # the model is the coordinator's file: as confined as the worker that started us
            confine([args.model], [])
        except SandboxError as e:
            print(json.dumps(dict(ok=False, sandbox=str(e))))
            return
    started = time.perf_counter()
    try:
        llm = llama_cpp.Llama(str(args.model), n_ctx=32, verbose=False, n_gpu_layers=args.gpu_layers)
        context = BatchContext(llm.model, args.parallel, args.window, 0, ContextSettings(args.kv, args.flash_attn))
        # A shared two-token prompt, then a different token for every sequence: a prefill and a decode step.
        context.decode([(t, k, list(range(args.parallel)), k == 1) for k, t in enumerate((1, 2))])
        context.decode([(3 + s, 2, [s], True) for s in range(args.parallel)])
        finite = bool(np.isfinite(np.stack([context.logits(i) for i in range(args.parallel)])).all())
        error = None if finite else "non-finite logits"
    except (DecodeError, ValueError) as e:  # a context or batch llama.cpp refused: no crash, but no use
        error = str(e)
    print(json.dumps(dict(ok=error is None, seconds=round(time.perf_counter() - started, 2), error=error)))


if __name__ == "__main__":
    main()
