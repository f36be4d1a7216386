"""`echo-node`: join a run as an inference peer. Heavy imports happen inside the command."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from protocols.supervise import run_and_exit

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Contribute rollouts to an Echo swarm run.")


@app.command()
def join(
    address: str = typer.Argument(..., help="Coordinator multiaddr, as printed by `echo-coordinator start`."),
    run_key: str = typer.Option(..., help="Fingerprint of the run key, as printed by the coordinator."),
    model: Optional[Path] = typer.Option(None, exists=True, dir_okay=False,
                                         help="Your copy of the run's base model GGUF (default: fetch it from the "
                                              "coordinator and peers, cached in --data-dir)."),
    name: Optional[str] = typer.Option(None, help="Public display name (default: from your key)."),
    data_dir: Path = typer.Option(Path("~/.echo-node"), help="Node key, adapters, logs."),
    threads: int = typer.Option(0, help="Generation threads (0 = all cores)."),
    backend: str = typer.Option("llama_cpp", help="llama_cpp (GGUF, any machine) or transformers (full-mode runs, "
                                                  "CUDA when present)."),
    gpu_layers: Optional[int] = typer.Option(None, help="llama.cpp layers to offload to the GPU (default: all when "
                                                        "llama.cpp was built with CUDA, Metal or Vulkan; 0 = CPU only)."),
    hours: Optional[str] = typer.Option(None, help="Local hours this node works, START-END (22-07: nights). Outside "
                                                   "them it finishes its lease and takes no other (default: always)."),
    max_vram: Optional[float] = typer.Option(None, help="GiB of GPU memory the node may take: it picks the layers "
                                                        "it offloads and the sequences it decodes at once to fit, "
                                                        "and says what it chose (default: what the model needs)."),
    kv: Optional[str] = typer.Option(None, help="llama.cpp's KV cache: f32 (the CPU's: the closest to the trainer "
                                                "there) or f16 (on a GPU with flash attention, what its kernels are "
                                                "built for). Default: f32 on the CPU; on a GPU f16 where it runs, "
                                                "else f32."),
    parallel: Optional[int] = typer.Option(None, help="Sequences to decode at once (default: 8 with llama.cpp, "
                                                      "1.9x one at a time on a 2-core CPU; GPUs do well at 32-64). "
                                                      "The KV cache holds this many context windows."),
    cpu_moe: bool = typer.Option(False, "--cpu-moe", help="Mixture-of-experts models: keep every expert tensor in "
                                                           "system RAM, the rest on the GPU (a 30B-A3B model on an "
                                                           "8 GB GPU)."),
    n_cpu_moe: int = typer.Option(0, help="... or only the first N layers' experts."),
    sandbox: bool = typer.Option(True, "--sandbox/--no-sandbox",
                                 help="llama.cpp parses files the coordinator chose in a worker process that can "
                                      "read only the model and its adapters, write none of your files and open no "
                                      "connection; on Linux the node will not run llama.cpp where it cannot be "
                                      "confined. --no-sandbox: no confinement (the worker process stays), for a "
                                      "kernel without Landlock or a GPU driver the sandbox keeps from working; "
                                      "please report it."),
    host: Optional[str] = typer.Option(None, help="Listen address for peers (default: 127.0.0.1 when the "
                                                  "coordinator is on 127.0.0.1, else 0.0.0.0)."),
    verbose: bool = typer.Option(False, "--verbose", help="A line per lease and update, and INFO logs, instead of "
                                                          "one live status line."),
    upload_mib_per_s: float = typer.Option(8.0, help="What this node uploads to peers (the base model and "
                                                     "updates it relays), MiB a second on average."),
    upload_gib_per_hour: float = typer.Option(4.0, help="... and GiB in any hour."),
    max_disk: float = typer.Option(100.0, help="GiB that --data-dir may hold: cached base models (the least "
                                               "recently used go first), adapters and full-mode weights."),
    allow_task: list[str] = typer.Option([], help="A run's environment named as module:Class that this node may "
                                                  "import and run (repeat for more). Importing runs the module's "
                                                  "code: allow only code you trust."),
) -> None:
    """Join a run: verify it, then generate rollouts until Ctrl-C."""
    from echo_node.config import NodeConfig
    from protocols.errors import ConfigError

    try:
        config = NodeConfig(
            address=address, run_key=run_key, model=model, name=name, data_dir=data_dir.expanduser(), threads=threads,
            backend=backend, gpu_layers=gpu_layers, hours=hours, max_vram_gib=max_vram, kv=kv, parallel=parallel,
            host=host, verbose=verbose,
            allow_tasks=frozenset(allow_task), upload_mib_per_s=upload_mib_per_s, upload_gib_per_hour=upload_gib_per_hour,
            max_disk_gib=max_disk, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, sandbox=sandbox,
        )
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    from echo_node.main import run_node

    raise typer.Exit(run_node(config))


@app.command()
def pause(data_dir: Path = typer.Option(Path("~/.echo-node"), help="The running node's --data-dir.")) -> None:
    """Pause a running node: it finishes its lease and takes no other until `echo-node resume`."""
    from echo_node.schedule import set_paused

    set_paused(data_dir.expanduser(), True)
    print(f"paused: nodes on {data_dir} take no new lease until `echo-node resume`")


@app.command()
def resume(data_dir: Path = typer.Option(Path("~/.echo-node"), help="The running node's --data-dir.")) -> None:
    """Let a paused node take leases again."""
    from echo_node.schedule import set_paused

    set_paused(data_dir.expanduser(), False)
    print(f"resumed: nodes on {data_dir} take leases again")


def main() -> None:
    run_and_exit(app)


if __name__ == "__main__":  # python -m echo_node.cli (the NAT test runs nodes in namespaces this way)
    main()
