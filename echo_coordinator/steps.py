"""The step loop: from the first nodes to the last evaluation, on the event loop.

Sequential pull: each step leases that step's seeds at the current version (reassigning leases
that time out) and waits for every group. Async push-pull: nodes lease and push continuously; a
step takes the oldest groups the staleness bound admits as soon as there are enough. Either way
one GRPO step runs on the torch thread, then, in this order: the step's checkpoint
(`checkpoints/vN`), its metrics line, `state.json` naming the new version (the step is done once
this file is replaced), its credits in the ledger, and the publish. A crash at any point resumes
at the version `state.json` names, with the journal's buffer and leases (`journal.py`); nodes
never hear of a version that a restart could lose.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from dataclasses import asdict, dataclass

from echo_coordinator.capacity import busy_share
from echo_coordinator.config import SHOWN_STABLE_STALENESS, RunConfig
from echo_coordinator.display import Display
from echo_coordinator.handlers import wait_for_nodes
from echo_coordinator.ledger import Ledger, MetricsLog
from echo_coordinator.run_dir import RunDir
from echo_coordinator.service import RunService, StepBatch
from echo_coordinator.torch_thread import TorchThread
from echo_coordinator.trainer.step_checks import Check
from echo_coordinator.verify import Verifier
from echo_coordinator.versions import Versions
from protocols.errors import VerificationError
from protocols.messages import RunManifest
from protocols.sync import Mode

LINGER_SECONDS = 40.0  # after the last step, how long to keep serving nodes that have not heard (past a
# node's longest retry delay, Backoff.cap, so a node that missed a short restarted run still hears)


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


@dataclass(frozen=True)
class Tally:
    """The service's and the verifier's running counts; a step's share is after minus before."""

    rejections: Counter[str]
    verified_samples: int
    verify_seconds: float
    expired_leases: int
    verified_free: int  # of verified_samples, scored from a step's own forward

    @classmethod
    def read(cls, service: RunService, verifier: Verifier) -> Tally:
        return cls(service.rejection_counts(), verifier.checked_samples, verifier.seconds, service.expired_leases(),
                   verifier.free_samples)


def step_record(mode: str, version: int, batch: StepBatch, stats, before: Tally, after: Tally,
                started: float, waited: float, now: float) -> dict:
    """The metrics.jsonl line of the step from `version` (`stats`: the trainer's StepStats;
    `started`: when the step began waiting for its batch)."""
    histogram = Counter(batch.staleness)
    model_turns = [sum(role == "model" for role, _, _ in turns(s)) for s in batch.samples]
    rejected = after.rejections - before.rejections
    return dict(
        version=version, mode=mode, samples=len(batch.samples),
        reward_mean=sum(batch.rewards) / max(len(batch.rewards), 1),
        accepted=len(batch.samples), rejected=sum(rejected.values()), rejected_by_reason=dict(rejected),
        verified_samples=after.verified_samples - before.verified_samples,
        verify_seconds=after.verify_seconds - before.verify_seconds,
        verified_free=after.verified_free - before.verified_free,
        dropped_stale=batch.dropped, staleness_max=max(batch.staleness, default=0),
        staleness_beyond_shown=max(batch.staleness, default=0) > SHOWN_STABLE_STALENESS,
        leases_expired=after.expired_leases - before.expired_leases,
        staleness_histogram={str(k): histogram[k] for k in sorted(histogram)},
        turns_mean=sum(model_turns) / max(len(model_turns), 1),
        step_seconds=now - started, wait_seconds=waited,
        busy_fraction=busy_share(now - started, waited), time=now,
        **{k: v for k, v in asdict(stats).items() if k not in ("samples", "verdicts")},
    )


class StepLoop:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, manifest: RunManifest, service: RunService, trainer,
                 torch: TorchThread, versions: Versions, verifier: Verifier, ledger: Ledger, display: Display):
        self.cfg, self.dir, self.manifest, self.service, self.trainer = cfg, run_dir, manifest, service, trainer
        self.torch, self.versions, self.verifier, self.ledger, self.display = torch, versions, verifier, ledger, display
        self.metrics: MetricsLog | None = None

    async def run(self) -> None:
        service = self.service
        await wait_for_nodes(self.cfg.min_nodes, service, self.display)
        service.begin()
        await self._train()
        service.finish()  # nothing left to train: serve every node its final fetch ourselves
        # Linger until every node has heard the run is over (and can fetch the final version).
        deadline = time.monotonic() + LINGER_SECONDS
        while not service.all_told_finished(time.time()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if service.told_behind():
            await asyncio.sleep(3.0)  # grace for their final update fetches

    async def _train(self) -> None:
        self.metrics = MetricsLog(self.dir.metrics)
        # The best and the worst sample of each step, as text: what the policy is doing.
        examples = MetricsLog(self.dir.transcripts)
        started = time.time()
        try:
            while self.service.version < self.cfg.steps:
                started = await self._step(examples, started)
            await self._finish_evals()
        finally:
            self.metrics.close()
            examples.close()

    async def _step(self, examples: MetricsLog, started: float) -> float:
        """One step from the current version; returns when it ended (the next one's start)."""
        service, versions, torch = self.service, self.versions, self.torch
        version = service.version
        before = Tally.read(service, self.verifier)
        batch = await self._verify_late(await self._collect(version), version)
        waited = time.time() - started
        stats = await self._train_step(batch, version)
        weights = await torch.call(versions.step_weights)
        published, held = await torch.call(versions.build_updates, version + 1, weights)
        await torch.call(versions.save_checkpoint, version + 1, weights)
        now = time.time()
        record = step_record(self.cfg.mode, version, batch, stats, before, Tally.read(service, self.verifier),
                             started, waited, now)
        self.metrics.write(record)
        self.dir.write_state(self.manifest.run_id, version + 1, service.state())  # the step is done
        await asyncio.to_thread(service.commit_step, version)  # its groups credited, once
        await torch.call(versions.serve, service, version + 1, published, held)
        self.ledger.set_run(version=service.version)
        ranked = sorted(batch.samples, key=lambda x: x.reward)[::-1]
        examples.write(dict(version=version, samples=[transcript(x, service.transcripts.decode)
                                                      for x in ranked[:1] + ranked[-1:]]))
        self.display.last_step = record
        self.display.say(
            f"version {version} -> {service.version}: reward {record['reward_mean']:.3f} over {len(batch.samples)} "
            f"samples (staleness max {record['staleness_max']}, {batch.dropped} dropped), wait {waited:.1f}s, "
            f"train {stats.busy_seconds:.1f}s, verify {record['verify_seconds']:.1f}s, "
            f"mismatch KL {stats.mismatch_kl:.4f}"
        )
        self._log_evals()
        return now

    async def _train_step(self, batch: StepBatch, version: int):
        """The trainer's step on `batch`, verifying its unchecked batches from its own forward
        (`trainer.step_checks`); their verdicts settled before the step is committed."""
        if not batch.unchecked:
            return await self.torch.call(self.trainer.step, batch.samples)
        checks = [Check(u.samples, tuple(u.seeds())) for u in batch.unchecked]
        stats = await self.torch.call(functools.partial(self.trainer.step, batch.samples, checks=checks,
                                                        held=self.verifier.held[version], rule=self.verifier.rule))
        self.verifier.counted(sum(len(v.evidence) for v in stats.verdicts), stats.check_seconds,
                              free=sum(v.free for v in stats.verdicts))
        await asyncio.to_thread(self.service.settle, [(u, v.reason) for u, v in zip(batch.unchecked, stats.verdicts)])
        return stats

    async def _verify_late(self, batch: StepBatch, version: int) -> StepBatch:
        """Unchecked batches this step cannot verify from its own forward (sampled with an older
        version, or after a restart into a setting that does not allow it) are verified apart
        now, as a push would have been; the refused leave the batch."""
        in_step = self.service.policing.in_step and version in self.verifier.held
        late = [u for u in batch.unchecked if not in_step or u.version != version]
        verdicts = []
        for u in late:
            try:
                reason, _ = await asyncio.to_thread(self.verifier.judged, u.version,
                                                    [batch.samples[i] for i in u.samples], u.seeds())
            except VerificationError as e:
                reason = e.code
            verdicts.append((u, reason))
        if late:
            await asyncio.to_thread(self.service.settle, verdicts)
        return batch.without(late, [u for u, reason in verdicts if reason is not None])

    async def _collect(self, version: int) -> StepBatch:
        """Sequential: lease this version's seeds and wait for every group. Async: take the oldest
        admissible groups as soon as there are enough; slow nodes never hold the trainer up."""
        cfg, service = self.cfg, self.service
        if service.mode is Mode.SEQUENTIAL:
            base = cfg.seed * 1_000_003 + version * cfg.prompts_per_step
            service.open_step(list(range(base, base + cfg.prompts_per_step)))
            while not service.step_done(time.time()):
                self._log_evals()
                await asyncio.sleep(0.1)
            return service.take_batch()
        while service.buffered_groups() < cfg.prompts_per_step:
            self._log_evals()
            await asyncio.sleep(0.1)
        return service.take_batch(cfg.prompts_per_step)

    def _log_evals(self, give_up: bool = False) -> None:
        """Write finished evaluation rounds to metrics.jsonl (lines with `eval_version`)."""
        for record in self.service.take_eval_records(give_up):
            self.metrics.write(record)
            self.display.last_eval = record
            accuracy = "-" if record["eval_accuracy"] is None else f"{record['eval_accuracy']:.3f}"
            self.display.say(f"evaluated version {record['eval_version']}: held-out accuracy {accuracy} "
                             f"({record['eval_sampling']}, {record['eval_samples']} samples, "
                             f"{record['eval_seconds']:.0f} s)"
                             + ("" if record["eval_complete"] else " [incomplete: gave up waiting]"))

    async def _finish_evals(self) -> None:
        """After the last step: no more training work; wait (at most a lease's time) for the open
        evaluation rounds, the last version's above all."""
        service, lease_seconds = self.service, self.cfg.lease_seconds
        service.end_training()
        deadline = time.monotonic() + lease_seconds
        if service.evaluating():
            self.display.waiting(f"waiting up to {lease_seconds:.0f} s for the last evaluations ...")
        while service.evaluating() and time.monotonic() < deadline:
            self._log_evals()
            await asyncio.sleep(0.2)
        self._log_evals(give_up=True)
