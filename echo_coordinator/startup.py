"""The coordinator's wiring, in start-up order: load the trainer (the slow part, ~15 s for
SmolLM2), start the DHT, publish the signed manifest, resume (or begin) at the version
`state.json` names, serve the nodes' streams, print the join line, then step (`steps.py`).

`Coordinator` holds the parts it builds and hands each to the module that uses it: the run
directory (`run_dir`), the torch thread (`torch_thread`), the service (`service`), the published
versions (`versions`), the DHT records (`presence`), the operator's display (`display`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from pathlib import Path

from echo_coordinator import base_model, memory_check
from echo_coordinator.config import RunConfig, TrainerConfig, staleness_caution
from echo_coordinator.display import Display, console, start_dashboard
from echo_coordinator.evaluation import EvalSet, eval_seeds
from echo_coordinator.handlers import register_handlers
from echo_coordinator.ledger import Ledger, MetricsLog
from echo_coordinator.presence import Presence
from echo_coordinator.run_dir import RunDir, RunState
from echo_coordinator.service import LeaseSettings, Policing, RunService, Work
from echo_coordinator.service.policing import read_allow_list
from echo_coordinator.trust import SpotCheck
from echo_coordinator.steps import StepLoop
from echo_coordinator.torch_thread import TorchThread
from echo_coordinator.trainer import distributed
from echo_coordinator.verify import Verifier
from echo_coordinator.versions import Versions
from engines.episodes import Transcripts, context_window
from protocols.errors import ConfigError, EchoError
from protocols.messages import RunManifest, TaskSpec
from protocols.multiaddr import tcp_port
from protocols.sampling import SamplingRule
from protocols.signing import fingerprint, load_or_create_key, public_bytes, sign_message
from protocols.supervise import Supervisor
from protocols.transport.relay import Relay
from protocols.uploads import UploadBudget
from tasks import TaskError, make_task


def join_command(address: str, run_key_fp: str) -> str:
    """Nodes fetch the base model from the swarm; one that holds it already adds `--model FILE`."""
    return f"echo-node join {address} --run-key {run_key_fp}"


class Coordinator:
    def __init__(self, run: RunConfig, trainer_config: TrainerConfig, model: Path, status=None):
        """What can be checked before anything slow starts: the tasks, the trainer's memory, the
        allow list, the run directory. `model`: the resolved base model (converted for the nodes in `run`)."""
        self.run_config, self.trainer_config, self.model = run, trainer_config, model
        self.dir = RunDir(run.data_dir)
        self.dir.create()
        self.key = load_or_create_key(self.dir.run_key)
        self.fp = fingerprint(public_bytes(self.key))
        try:
            self.task = make_task(run.task, run.task_params)
            self.eval_task = make_task(run.task, run.eval_task_params or run.task_params)
        except TaskError as e:
            raise EchoError(str(e)) from None
        if run.eval_task_params and self.task.max_turns > 1:
            raise EchoError("eval_task_params: a multi-turn task is evaluated with the run's own parameters "
                            "(nodes play the run's environment); remove eval_task_params")
        if trainer_config.sharding == "fsdp" and trainer_config.procs == 1 and distributed.Ranks.from_env() is None:
            raise ConfigError('sharding = "fsdp" shards the trainer across processes, and this run has one: '
                              'set [trainer] procs (or --trainer-procs), or start it under torchrun')
        # Before any weights load (or a checkpoint converts): a trainer this machine cannot hold is refused.
        memory_check.check_start(model, run, trainer_config, multi_turn=self.task.max_turns > 1)
        self.dir.write_config(run, trainer_config)
        self.torch = TorchThread()
        self.display = Display(status)
        self.service: RunService | None = None
        try:
            self.allow = read_allow_list(Path(run.allow_keys).expanduser()) if run.allow_keys else None
        except (OSError, ValueError) as e:
            raise EchoError(f"allow_keys: {e}") from None

    @property
    def version(self) -> int:
        return self.service.version if self.service else 0

    async def run(self) -> None:
        """The run until it ends: the trainer and the DHT up, then `_serve`."""
        from echo_coordinator.trainer.learner import Trainer  # heavy: torch, transformers
        from protocols.transport.dht import SwarmDHT

        cfg = self.run_config
        if self.model.is_dir():
            self.display.waiting(f"making the nodes' GGUF ({cfg.node_quant}) of {self.model.name} "
                                 "(cached after the first run) ...")
        self.base = await asyncio.to_thread(base_model.prepare, str(self.model), cfg.node_quant, self.dir.models)
        self.dir.record_base(self.base)
        self.display.waiting(f"loading the trainer on {self.model.name} ...")
        trainer = await self._start_trainer(Trainer)
        self.checker = trainer
        if not self.base.is_gguf:
            # Verification checks samples against the weights the nodes run. From an HF checkpoint
            # those are a quantization of the trainer's: a copy of the model loaded from the nodes'
            # GGUF does the checking, so an honest node differs from it by llama.cpp's arithmetic
            # alone, as in a GGUF run. (Against the full-precision trainer, SmolLM2 q4_k_m nodes
            # flip 12 % of tokens and every batch is refused: docs/models.md.)
            self.display.waiting(f"loading the nodes' {cfg.node_quant} weights for verification ...")
            self.checker = await self.torch.call(functools.partial(
                Trainer, self.base.node_gguf, self.trainer_config, cfg.temperature, cfg.seed, cfg.update, frozen=True))
        # A persistent libp2p identity keeps our address stable, so nodes reconnect after a restart.
        # main thread: see SwarmDHT.start
        dht = SwarmDHT.start(cfg.host, cfg.port or self._previous_port(), None, self.dir.p2p_id,
                             run_fingerprint=self.fp, public=True)
        try:
            await self._serve(dht, trainer)
        finally:
            dht.shutdown()
            if trainer.ranks is not None:
                with contextlib.suppress(distributed.DistributedError):
                    await self.torch.call(trainer.channel.send, distributed.STOP)

    async def _start_trainer(self, trainer_class):
        """The trainer; with `procs` > 1 (or under torchrun) rank 0 of a group of trainer
        processes, which it waits to join. A local rank that dies before joining is reported."""
        cfg, tcfg = self.run_config, self.trainer_config
        ranks, workers = distributed.Ranks.from_env(), []
        if ranks is None and tcfg.procs > 1:
            workers = distributed.start_workers(tcfg.procs, self.dir.trainer_log)
            ranks = distributed.Ranks.from_env()
        if ranks is not None:
            self.display.waiting(f"loading the trainer on {self.model.name}: rank 0 of {ranks.world} ...")
        load = asyncio.ensure_future(self.torch.call(trainer_class, self.model, tcfg, cfg.temperature, cfg.seed,
                                                     cfg.update, ranks))
        while not load.done():
            for rank, worker in enumerate(workers, 1):
                if worker.poll() is not None:
                    raise distributed.DistributedError(
                        f"trainer rank {rank} exited with code {worker.returncode} before joining; see "
                        f"{self.dir.trainer_log(rank)}")
            await asyncio.wait({load}, timeout=0.5)
        return load.result()

    def _previous_port(self) -> int:
        """`port = 0` on a restart: the port of the join line nodes already have, if it is free,
        so they reconnect; else any."""
        import socket

        try:
            port = tcp_port(self.dir.join_file.read_text())
            with socket.socket() as probe:
                probe.bind((self.run_config.host, port))
            return port
        except (OSError, IndexError, ValueError):
            return 0

    async def _serve(self, dht, trainer) -> None:
        """From what `state.json` says to the end of the run: the manifest, the service and the
        versions (resumed or begun), the streams, the background tasks and the join line, then
        the steps."""
        cfg = self.run_config
        state = self.dir.load_state()
        addresses = [a for a in dht.addresses() if f"/ip4/{cfg.host}/" in a] or dht.addresses()
        run_id = state.run_id if state else f"run-{self.fp[:8]}-{int(time.time())}"
        base_file = await asyncio.to_thread(base_model.model_file, self.base.node_gguf, run_id, self.key)
        manifest = self._manifest(run_id, base_file.sha256, trainer.tokenizer, addresses)
        ledger = Ledger(self.dir.ledger)
        presence = Presence(dht, self.fp)
        verifier = self._verifier()
        service = self.service = self._service(manifest, trainer.tokenizer, ledger, self._relay(base_file, presence),
                                               verifier, in_step=self.checker is trainer and trainer.verifies_in_step)
        versions = await self._resume(state, manifest, service, verifier, trainer)
        ledger.set_run(run_id=manifest.run_id, mode=cfg.mode, version=service.version, run_key=self.fp, steps=cfg.steps,
                       model=self.model.name, task=cfg.task, staleness=cfg.staleness,
                       samples_per_step=cfg.prompts_per_step * cfg.group_size,
                       resumed_at=service.version if state else None)
        prober = await self._open_streams(dht, service, presence, addresses[0])

        supervisor = Supervisor()
        supervisor.start(presence.refresh(manifest, service), "dht-refresh")
        dashboard = start_dashboard(cfg, self.dir, ledger, service)
        self._announce(manifest, addresses[0], dashboard[1] if dashboard else None)
        if self.display.status is not None:
            supervisor.start(self.display.show_status(service, cfg.steps), "status-line")
        steps = StepLoop(cfg, self.dir, manifest, service, trainer, self.torch, versions, verifier, ledger, self.display)
        try:
            await supervisor.run(steps.run())
        finally:
            await prober.close()
            if dashboard:
                dashboard[0].cancel()
                await asyncio.gather(dashboard[0], return_exceptions=True)
            ledger.close()

    def _relay(self, base_file, presence: Presence) -> Relay:
        """What serves updates and the base model to nodes, with the peers that hold them."""
        cfg = self.run_config
        # The trainer sends about `trainer_upload_copies` of each update; nodes relay the rest.
        budget = UploadBudget(cfg.trainer_upload_copies) if cfg.trainer_upload_copies > 0 else None
        relay = Relay(budget=budget, peers_holding=presence.holding)
        relay.serve_file(base_file, self.base.node_gguf)  # nodes without the base fetch it from us and their peers
        return relay

    def _verifier(self) -> Verifier:
        cfg = self.run_config
        return Verifier(
            self.checker.evidence, SamplingRule(),
            # One version more than the bound admits: a publish remembers the new version a moment
            # before the gate moves to it.
            keep_versions=(cfg.staleness if cfg.mode == "async" else 0) + 1,
            # Verification runs the trainer's forward pass, so on the torch thread; handler threads wait.
            run=self.torch.run,
        )

    async def _open_streams(self, dht, service: RunService, presence: Presence, address: str):
        """The stream handlers on the DHT's endpoint, and the reachability prober; returns the prober."""
        from protocols.transport.reach import Prober  # hivemind

        endpoint = await dht.endpoint()
        prober = Prober(self.run_config.host, address)
        await prober.start()
        await register_handlers(endpoint, service, presence, prober)
        return prober

    def _manifest(self, run_id: str, base_sha256: str, tokenizer, addresses: list[str]) -> RunManifest:
        """The run's signed manifest: what a node needs to take part."""
        from engines.hf import turn_format

        cfg, tcfg = self.run_config, self.trainer_config
        return sign_message(RunManifest(
            run_id=run_id, base_model=self.base.node_gguf.name, base_sha256=base_sha256, vocab_size=len(tokenizer),
            mode=cfg.mode, update=cfg.update, staleness=cfg.staleness,
            task=TaskSpec(cfg.task, dict(cfg.task_params), self.task.max_turns),
            group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            run_key=public_bytes(self.key), trainer_addrs=tuple(addresses),
            update_params={"rank": tcfg.lora_rank, "alpha": tcfg.lora_alpha}, turns=turn_format(tokenizer),
            created=time.time(),
        ), self.key)

    def _service(self, manifest: RunManifest, tokenizer, ledger: Ledger, relay: Relay,
                 verifier: Verifier, in_step: bool) -> RunService:
        from engines.hf import prompt_ids

        cfg = self.run_config
        evaluation = None
        if cfg.eval_every:
            evaluation = EvalSet.of(eval_seeds(cfg.eval_prompts),
                                    lambda seed: prompt_ids(tokenizer, self.eval_task.episode(seed).messages),
                                    cfg.eval_sampling, cfg.eval_samples)
        work = Work(self.task, render_prompt=lambda seed: prompt_ids(tokenizer, self.task.episode(seed).messages),
                    transcripts=Transcripts.of(tokenizer, manifest.turns, cfg.max_new_tokens, context_window(
                        cfg.max_new_tokens, self.task.max_turns > 1)),
                    evaluation=evaluation, eval_task=self.eval_task)
        # A lease is a quarter of a step's prompts, or up to half a step to fill a proven node's batch.
        settings = LeaseSettings(lease_seconds=cfg.lease_seconds, seeds_per_lease=max(1, cfg.prompts_per_step // 4),
                                 largest_lease=max(1, cfg.prompts_per_step // 2),
                                 first_seed=cfg.seed * 1_000_003 + 500_000,
                                 max_ahead=cfg.lead_steps * cfg.prompts_per_step, lag=cfg.lag)
        return RunService(manifest, self.key, ledger, work, settings,
                          Policing(verifier, SpotCheck(cfg.verify_fraction), allow=self.allow, in_step=in_step), relay)

    async def _resume(self, state: RunState | None, manifest: RunManifest, service: RunService, verifier: Verifier,
                      trainer) -> Versions:
        """The published versions, at the version `state.json` names: a restart continues there;
        a new run names version 0 before any work is accepted."""
        resumed = state is not None and state.version > 0
        versions = Versions(self.run_config, self.dir, self.key, manifest, verifier, trainer, self.checker,
                            self.base.node_gguf, state.checkpoint if resumed else None)
        if state:
            # The version comes back with the trainer's weights, the gate, and from the journal the
            # buffered groups and the leases nodes hold.
            service.restore(state.service, state.version)
            MetricsLog.rewind(self.dir.metrics, state.version)
            console.print(f"resuming run {manifest.run_id} at version {service.version} "
                          f"({len(service.replay)} groups buffered)")
        if resumed:
            await self.torch.call(trainer.load, state.checkpoint)
            versions.resume(service)
        else:
            versions.begin(service)
            self.dir.write_state(manifest.run_id, 0, service.state())  # the run's id, before any work is accepted
        return versions

    def _announce(self, manifest: RunManifest, address: str, dashboard_url: str | None) -> None:
        """The join line, on the console and in `join.txt`, and the dashboard's URL."""
        cfg = self.run_config
        line = join_command(address, self.fp)
        if caution := staleness_caution(cfg.mode, cfg.staleness):
            console.print(f"[yellow]{caution}[/]")
        console.print(f"[bold]run {manifest.run_id}[/] ({cfg.mode}, {cfg.task}); volunteers join with:")
        print(f"  {line}", flush=True)  # never wrapped: people copy this line
        self.dir.write_join(line)  # after the console: a script that waits for the file finds both
        if dashboard_url:
            console.print(f"dashboard: {dashboard_url}")
