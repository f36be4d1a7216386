"""The node process: verify the run, then lease -> update -> generate -> sign -> push, until the
run ends or Ctrl-C.

Trust: the join line pins the run key's fingerprint. The manifest, every WeightUpdate and
(through their hashes) every chunk are checked against it before use; a failed update leaves
the node on its old version, still serving. Generation runs in a worker thread so the event
loop keeps the DHT announcement fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from echo_node.base_download import download, fetch_model_file, known_sha256, progress_line
from echo_node.episodes import play
from echo_node.full_weights import export_quantized, load_master
from echo_node.updates import UpdateError, apply_update, catch_up, load_lora
from protocols import rpc, sampling
from protocols.errors import EchoError, ProtocolError, RemoteError, SignatureError, TransportError
from protocols.messages import (
    LeaseRequest, ModelFile, NoWork, PeerAnnouncement, PushReceipt, ReachReply, ReachRequest, RolloutBatch, RolloutSample,
    RunManifest, TaskLease, WeightUpdate, verified_announcements,
)
from protocols.supervise import Backoff
from protocols.signing import (
    FINGERPRINT_CHARS, fingerprint, load_or_create_key, public_bytes, sign_message, verify_message,
)
from protocols.sync import must_update
from protocols.transport.relay import Relay
from protocols.wire import decode_one_of
from tasks import TaskError, make_task

log = logging.getLogger(__name__)
console = Console(soft_wrap=True)

ANNOUNCE_TTL = 60.0  # seconds
PEER_REFRESH = 5.0  # seconds between re-announcing and re-reading peers' versions
MANIFEST_WAIT = 60.0  # seconds to find the run's manifest in the DHT before giving up
CALL_TIMEOUT = 60.0
BUSY_RETRY = 0.3  # seconds; the trainer's copy went to a peer that will relay it shortly
UNREACHABLE_SAY = 60.0  # seconds without an answer from the coordinator before we say so (then each such period)
STOP_SECONDS = 5.0  # on Ctrl-C, how long the work gets to end before we leave anyway
FIRST_LEASE_SEEDS = 1  # a node's first lease is one prompt's group: its first rollout is accepted sooner
RELAY_CHECK = 15.0  # seconds between a node's checks that its relay reservation holds (behind NAT)


class JoinRefused(EchoError):
    """The run cannot be joined: wrong key, wrong base model, or not found."""


class Stopped(EchoError):
    """Ctrl-C arrived during generation (the unfinished batch is dropped, its lease expires) or
    before the node could start (a base model download resumes on the next join)."""


@dataclass(frozen=True)
class NodeConfig:
    address: str  # coordinator multiaddr from the join line
    run_key: str  # pinned run-key fingerprint
    model: Path | None = None  # this node's copy of the base model GGUF; None: fetch it from the swarm
    name: str | None = None  # public display name
    data_dir: Path = Path("~/.echo-node")
    threads: int = 0  # generation threads; 0 = all cores
    backend: str = "llama_cpp"  # "llama_cpp" (GGUF, any machine) or "transformers" (full mode, CUDA if present)
    gpu_layers: int | None = None  # llama.cpp layers to offload; None: all when llama.cpp has a GPU backend
    host: str | None = None  # listen address; None: loopback for a coordinator on loopback, else every interface
    verbose: bool = False  # a line per lease and update, and INFO logs, instead of one live status line


def run_node(config: NodeConfig) -> int:
    # On a terminal, one live status line; in a log file (or with --verbose), a line per event.
    live = console.is_terminal and not config.verbose
    logging.basicConfig(level=logging.WARNING if live else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with console.status("starting ...") if live else contextlib.nullcontext() as status:
            asyncio.run(Node(config, status).run())
    except JoinRefused as e:
        console.print(f"[red]refused to join:[/] {e}")
        return 3
    except Stopped as e:  # asked to stop, like a Ctrl-C mid-run: not a failure
        console.print(f"[yellow]{e}[/]")
        return 0
    except (EchoError, OSError) as e:
        console.print(f"[red]error:[/] {e}")
        return 1
    return 0


def trainer_peer(manifest: RunManifest) -> str:
    from protocols.transport.dht import peer_of

    for address in manifest.trainer_addrs:
        if "/p2p/" in address:
            return peer_of(address)
    raise JoinRefused("the run manifest names no trainer peer")


class Phases:
    """Where a node's time went from its start to its first accepted rollout: each `mark` ends
    a phase (marks after the last phase are ignored; a phase seen again, say a lease whose push
    was refused, adds to the time since the previous mark)."""

    def __init__(self):
        self.started = self.previous = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.done = False

    def mark(self, phase: str, last: bool = False) -> bool:
        """End `phase` now; True when this ended the last phase."""
        if self.done:
            return False
        now = time.monotonic()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.previous
        self.previous, self.done = now, last
        return last

    def total(self) -> float:
        return self.previous - self.started

    def summary(self) -> str:
        return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.seconds.items())


class Node:
    def __init__(self, config: NodeConfig, status=None):
        if len(config.run_key) != FINGERPRINT_CHARS or not config.run_key.isalnum():
            raise JoinRefused(f"--run-key must be the {FINGERPRINT_CHARS}-character fingerprint the coordinator printed")
        self.config = config
        self.data_dir = Path(config.data_dir).expanduser()
        (self.data_dir / "adapters").mkdir(parents=True, exist_ok=True)
        self.key = load_or_create_key(self.data_dir / "node.key")
        self.node_key = public_bytes(self.key)
        self.name = config.name or f"node-{fingerprint(self.node_key)[:6]}"
        self.version = 0  # the last version whose update was fully verified and applied
        self.loaded = 0  # full mode: the version the backend serves (master weights may be ahead mid-chain)
        self.master: dict = {}  # what updates apply to: the LoRA adapter (none at version 0), or full weights
        self.stopping = asyncio.Event()
        self.relay = Relay()
        self.version_changed = asyncio.Event()
        self.peer_versions: dict[str, int] = {}  # libp2p peer id -> version it announced
        self.stop_requested = threading.Event()  # seen by the generation thread (llama.cpp: between tokens)
        self.task = None  # multi-turn runs: the environment this node steps (see _load_task)
        self.status = status  # rich Status: the live line, or None to print each event
        self.accepted = 0  # samples the trainer accepted from us since we joined
        self.latest = 0  # the newest version the trainer told us of
        self.last_answer = time.monotonic()  # the coordinator last answered us (anything, even a refusal)
        self.said_unreachable = 0.0  # when we last said it has not
        self.joining = Phases()  # where the time from start to the first accepted rollout went
        self.relay_addrs: tuple[str, ...] = ()  # behind NAT: the relay circuit others reach us through
        self.via_relay: str | None = None  # behind NAT: the coordinator address we hold a relay reservation at

    def _say(self, event: str) -> None:
        """An event: a line of its own without a live status line, else folded into that line."""
        if self.status is None:
            console.print(event)
            return
        lag = max(0, self.latest - self.version)
        self.status.update(f"{self.name}: version {self.version} (lag {lag}) · {self.accepted} samples accepted · "
                           f"{self.backend.throughput:.0f} tok/s · {event}")

    def _waiting(self, what: str) -> None:
        """A long wait, shown on the live line (and logged without one)."""
        if self.status is not None:
            self.status.update(what)
        else:
            log.info(what)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._request_stop)
        dht = await self._join_dht()
        if dht is None:
            return  # stopped before the coordinator could be reached
        try:
            dht = await self._behind_nat(dht)
            self.joining.mark("DHT")
            if dht is not None:
                await self._run(dht)
        finally:
            if dht is not None:
                dht.shutdown()

    async def _join_dht(self):
        """The DHT, through the coordinator's address; while it cannot be reached (not started
        yet, restarting) keep trying with backoff and say so. None if stopped meanwhile."""
        from protocols.transport.dht import SwarmDHT

        backoff = Backoff()
        while not self.stopping.is_set():
            try:
                # main thread: see SwarmDHT.start
                return SwarmDHT.start(self.host, 0, [self.config.address], run_fingerprint=self.config.run_key,
                                      relay=self.via_relay)
            except TransportError as e:
                await self._retry(e, backoff)
        return None

    @property
    def host(self) -> str:
        if self.config.host is not None:
            return self.config.host
        return "127.0.0.1" if self.config.address.startswith(("/ip4/127.", "/ip6/::1/")) else "0.0.0.0"

    async def _reach(self, dht, relayed: bool) -> bool | None:
        """Can the coordinator dial us (directly, or through its relay)? None if it cannot say."""
        from protocols.transport.dht import peer_of

        endpoint = await dht.endpoint()
        ports = [a.split("/tcp/", 1)[1].split("/", 1)[0] for a in dht.addresses() if "/tcp/" in a]
        try:
            raw = await endpoint.call_one(peer_of(self.config.address), rpc.REACH,
                                          ReachRequest(int(ports[0]), relayed).to_wire(), timeout=CALL_TIMEOUT)
            return ReachReply.from_wire(raw).reachable
        except (TransportError, ProtocolError, IndexError) as e:
            log.info("reachability check: %s", e)
            return None

    async def _behind_nat(self, dht):
        """Our DHT, or when the coordinator cannot dial us, a DHT client that asks the coordinator
        for a relay reservation (`_confirm_relay` announces it once it holds). None if stopped."""
        if await self._reach(dht, relayed=False) is not False:
            return dht
        console.print("this node cannot be dialled directly (behind NAT or a firewall): it joins as a DHT client "
                      "and is reached through the coordinator's relay")
        dht.shutdown()
        self.via_relay = self.config.address
        return await self._join_dht()

    async def _confirm_relay(self, dht) -> None:
        """Behind NAT: until the coordinator can dial us through its relay, ask again now and then;
        then announce the circuit, so that peers can fetch from us. libp2p makes the reservation
        within seconds when it knows 4 relays, else after its 3-minute boot delay; meanwhile the
        node works as usual (everything it does, it dials out for)."""
        started = time.monotonic()
        while not self.stopping.is_set():
            if await self._reach(dht, relayed=True):
                self.relay_addrs = (f"{self.config.address}/p2p-circuit",)
                self.version_changed.set()  # announce it now
                console.print(f"reachable through the relay at {escape(self.config.address)} "
                              f"(after {time.monotonic() - started:.0f} s)")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), RELAY_CHECK)

    def _load_backend(self) -> None:
        """The generation backend, and in full mode the float32 master weights updates apply to
        (in LoRA mode they are the adapter, empty until the first update)."""
        if self.config.backend == "transformers":
            from echo_node.transformers_backend import TransformersBackend

            if self.manifest.update != "full":
                raise JoinRefused("the transformers backend takes full-parameter runs (update = \"full\") only")
            self.backend = TransformersBackend(self.model, self.config.threads)
            self.master, self.hf_config = self.backend.master, self.backend.config
            return
        from echo_node.llama_backend import LlamaBackend

        multi_turn = self.manifest.task.max_turns > 1
        n_ctx = 4096 if self.manifest.max_new_tokens > 2048 or multi_turn else 2048
        self.backend = LlamaBackend(self.model, self.config.threads, n_ctx, interrupt=self.stop_requested,
                                    gpu_layers=self.config.gpu_layers)
        if self.manifest.update == "full":
            self.hf_config, self.master = load_master(self.model)

    async def _run(self, dht) -> None:
        from protocols.transport.dht import record_key

        self.endpoint = await dht.endpoint()
        manifest = await self._fetch_manifest(dht, record_key(self.config.run_key, "manifest"))
        self.manifest, self.trainer = manifest, trainer_peer(manifest)
        peers_key = record_key(self.config.run_key, "peers")
        model_file = await self._model_file()
        self.joining.mark("manifest")
        self.model = await self._until_stopped(self._base_model(model_file, dht, peers_key), "fetching the base model")
        self.joining.mark("base model")
        self.relay.serve_file(model_file, self.model)  # every node serves the base to later joiners
        self.task = self._load_task() if manifest.task.max_turns > 1 else None
        self._waiting(f"loading {manifest.base_model} ...")
        await asyncio.to_thread(self._load_backend)
        await self.relay.serve(self.endpoint)
        self.joining.mark("model load")
        console.print(f"joined run {manifest.run_id} as {self.name} (node key {fingerprint(self.node_key)}); "
                      f"task {manifest.task.name}, mode {manifest.mode}; {self.backend.hardware}")
        announcer = asyncio.create_task(self._announce(dht, peers_key), name="announce")
        work = asyncio.create_task(self._work_loop(announcer), name="work")
        stop = asyncio.create_task(self.stopping.wait(), name="stop")
        relay = asyncio.create_task(self._confirm_relay(dht), name="relay") if self.via_relay else None
        try:
            # Ctrl-C cancels whatever call is in flight instead of waiting out its timeout.
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()  # re-raise what ended the work loop
        finally:
            self.stopping.set()
            tasks = {work, stop, announcer} | ({relay} if relay else set())
            for task in tasks:
                task.cancel()
            # Bounded: the generation thread stops at its next token.
            await asyncio.wait(tasks, timeout=STOP_SECONDS)
            try:
                # Withdraw: a signed "left" announcement outlives the live one (the DHT keeps the later expiry).
                await dht.put(peers_key, self._announcement(left=True).to_wire(), ANNOUNCE_TTL * 2,
                              subkey=fingerprint(self.node_key), timeout=2.0)
            except TransportError as e:
                log.warning("could not withdraw the announcement: %s", e)
            console.print(f"left the run at version {self.version}")

    async def _model_file(self) -> ModelFile:
        """The run's signed chunk list of its base model, from the trainer (retried while it
        cannot be reached)."""
        backoff = Backoff()
        while True:
            try:
                return await fetch_model_file(self.endpoint, self.trainer, self.manifest, CALL_TIMEOUT)
            except TransportError as e:
                await self._retry(e, backoff)
                if self.stopping.is_set():
                    raise Stopped("stopped before the run's base model was known") from None
            except (ProtocolError, SignatureError, UpdateError) as e:
                raise JoinRefused(f"the run's base model list is not valid: {e}") from None

    async def _base_model(self, model_file: ModelFile, dht, peers_key: str) -> Path:
        """`--model`, checked against the run's base; without it the base from the swarm."""
        if self.config.model is not None:
            model_sha = await asyncio.to_thread(known_sha256, self.config.model, self.data_dir / "models")
            if model_sha != self.manifest.base_sha256:
                raise JoinRefused(
                    f"your model {self.config.model.name} (sha256 {model_sha[:12]}) is not this run's base model "
                    f"{self.manifest.base_model} (sha256 {self.manifest.base_sha256[:12]}); leave out --model "
                    "to fetch it from the swarm")
            return self.config.model

        async def holders() -> list[str]:
            """Peers announcing this base, newest version first (likeliest to be up)."""
            try:
                announced = verified_announcements(await dht.get(peers_key))
            except TransportError:
                return []
            self.endpoint.learn_relays(announced)  # the whole set, as the announcer's refresh does
            found = [a for a in announced if a.model_sha256 == self.manifest.base_sha256]
            return [a.peer_id for a in sorted(found, key=lambda a: -a.version)]

        def show(done: int, total: int, seconds: float, fetched: int) -> None:
            line = progress_line(done, total, seconds, fetched)
            if self.status is not None:
                self.status.update(line)
            elif done == total or time.monotonic() - self.said_progress > 2.0:
                self.said_progress = time.monotonic()
                console.print(line)

        self.said_progress = 0.0
        try:
            path, sources = await download(self.endpoint, self.trainer, holders, model_file,
                                           self.data_dir / "models", show, CALL_TIMEOUT)
        except (UpdateError, ProtocolError, TransportError) as e:
            raise EchoError(f"could not fetch the base model: {e}; run the same command to resume") from None
        if sources:
            from_trainer = sources.pop(self.trainer, 0)
            console.print(f"fetched the base model {self.manifest.base_model} ({model_file.size / 1e6:.1f} MB): "
                          f"{sum(sources.values()) / 1e6:.1f} MB from {len(sources)} peers, "
                          f"{from_trainer / 1e6:.1f} MB from the coordinator")
        return path

    async def _until_stopped(self, work, what: str):
        """`work`'s result, unless Ctrl-C comes first: then it is cancelled and `Stopped` raised."""
        task = asyncio.ensure_future(work)
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Stopped(f"stopped while {what}; the same command resumes where it stopped")

    def _request_stop(self) -> None:
        self.stopping.set()
        self.stop_requested.set()

    def _load_task(self):
        """A multi-turn run's environment, which this node steps itself. Single-turn runs need none:
        the trainer sends rendered prompts."""
        try:
            return make_task(self.manifest.task.name, self.manifest.task.params)
        except TaskError as e:
            raise JoinRefused(f"this run's environment is not available here ({e}); install the package "
                              f"that provides {self.manifest.task.name!r}") from None

    async def _fetch_manifest(self, dht, key: str) -> RunManifest:
        """The manifest from the DHT record under the pinned fingerprint; failing that (absent, or a
        record that does not verify: the DHT is not to be trusted), straight from the peer at the
        join address, whose answer is final, so a wrong key is reported at once, not after a wait."""
        from protocols.transport.dht import peer_of

        deadline = time.monotonic() + MANIFEST_WAIT
        coordinator = peer_of(self.config.address)
        self._waiting(f"looking for the run at {self.config.address} ...")
        while True:
            raw = await dht.get(key)
            if isinstance(raw, bytes):
                try:
                    return self._verify_manifest(raw)
                except JoinRefused as e:
                    log.warning("ignoring a bad manifest record in the DHT (%s); asking the coordinator", e)
            try:
                raw = await self.endpoint.call_one(coordinator, rpc.MANIFEST, b"", idempotent=True)
                return self._verify_manifest(raw)
            except (TransportError, RemoteError) as e:
                log.info("manifest not available yet: %s", e)
            if time.monotonic() > deadline:
                raise JoinRefused(f"no run with key {self.config.run_key} found via {self.config.address} "
                                  f"within {MANIFEST_WAIT:.0f} s; check the join line")
            await asyncio.sleep(1.0)

    def _verify_manifest(self, raw: bytes) -> RunManifest:
        try:
            manifest = RunManifest.from_wire(raw)
        except ProtocolError as e:
            raise JoinRefused(f"the run's manifest is malformed: {e}") from None
        found = fingerprint(manifest.run_key)
        if found != self.config.run_key:
            raise JoinRefused(f"the run at {self.config.address} is signed by key {found}, "
                              f"not the key {self.config.run_key} you asked to trust")
        try:
            verify_message(manifest, manifest.run_key)
        except SignatureError as e:
            raise JoinRefused(f"the run's manifest signature is invalid: {e}") from None
        return manifest

    async def _announce(self, dht, key: str) -> None:
        """Keep our announcement fresh (at once when our version changes) and learn which peers
        hold which version, for the relay."""
        while not self.stopping.is_set():
            try:
                await dht.put(key, self._announcement().to_wire(), ANNOUNCE_TTL, subkey=fingerprint(self.node_key))
                announced = verified_announcements(await dht.get(key))
                self.peer_versions = {a.peer_id: a.version for a in announced}
                self.endpoint.learn_relays(announced)
            except TransportError as e:
                log.warning("announcing failed, will retry: %s", e)
            self.version_changed.clear()
            try:
                async with asyncio.timeout(PEER_REFRESH):
                    await self.version_changed.wait()
            except TimeoutError:
                pass

    def _announcement(self, left: bool = False) -> PeerAnnouncement:
        return sign_message(PeerAnnouncement(
            peer_id=self.endpoint.peer_id, name=self.name, role="node", backend=self.backend.name,
            model_sha256=self.manifest.base_sha256, version=self.version, throughput=self.backend.throughput,
            public_key=self.node_key, time=time.time(), left=left, hardware=self.backend.hardware,
            relay_addrs=self.relay_addrs,
        ), self.key)

    async def _work_loop(self, announcer: asyncio.Task) -> None:
        """Lease, generate, push; a batch's push (the trainer verifying it) overlaps the next
        lease's generation, and at most one push is in flight."""
        backoff, pushing = Backoff(), None
        try:
            while True:
                if announcer.done():
                    announcer.result()  # re-raise why announcing failed
                try:
                    reply = await self._request_lease()
                    self.last_answer = time.monotonic()
                    if isinstance(reply, NoWork):
                        if reply.finished:
                            if pushing is not None:
                                await pushing
                            await self._finish(reply.latest_version)
                            return
                        self.latest = max(self.latest, reply.latest_version)
                        self._say("waiting for work")
                        await asyncio.sleep(reply.retry_after)
                        continue
                    self.latest = max(self.latest, reply.version)
                    await self._prepare(reply)
                    self.joining.mark("first lease")
                    self._say(f"{'evaluating' if reply.evaluation else 'generating'} {len(reply.seeds)} prompts")
                    batch = await asyncio.to_thread(self._generate, reply)
                    self.joining.mark("generation")
                    if pushing is not None:
                        await pushing
                    pushing = asyncio.create_task(self._deliver(batch, reply.expires_at), name="push")
                    backoff.reset()
                except RemoteError as e:
                    self.last_answer = time.monotonic()
                    if e.code == "not_allowed":
                        raise self._not_admitted() from None
                    await self._retry(e, backoff)
                except (TransportError, ProtocolError, UpdateError) as e:
                    await self._retry(e, backoff)
        finally:
            if pushing is not None:
                pushing.cancel()  # stopping: the lease expires at the trainer, as with a batch cut short

    async def _deliver(self, batch: RolloutBatch, expires_at: float) -> None:
        """Push one batch and account for the answer. A refused or undeliverable batch is logged
        and left to expire at the trainer; only a key the run does not admit ends the node."""
        try:
            receipt = await self._push(batch, expires_at)
        except RemoteError as e:
            self.last_answer = time.monotonic()
            if e.code == "not_allowed":
                raise self._not_admitted() from None
            log.warning("lease %s was refused: %s", batch.lease_id, e)
            return
        except (TransportError, ProtocolError) as e:
            log.warning("lease %s was not delivered: %s", batch.lease_id, e)
            return
        if receipt.accepted and self.joining.mark("push", last=True):
            console.print(f"first rollout accepted {self.joining.total():.1f} s after start "
                          f"({self.joining.summary()})")
        self.accepted += receipt.accepted
        self.latest = max(self.latest, receipt.latest_version)
        tokens = sum(len(x.completion_ids) for x in batch.samples)
        self._say(f"lease {batch.lease_id}: {receipt.accepted} samples ({tokens} tokens) accepted at version "
                  f"{batch.version}, {self.backend.throughput:.0f} tok/s")

    def _not_admitted(self) -> JoinRefused:
        return JoinRefused(f"this run admits only listed node keys; ask its operator to add {fingerprint(self.node_key)}")

    async def _retry(self, error: Exception, backoff: Backoff) -> None:
        """Log a failed round and wait (a stop ends the wait); say so plainly when the coordinator
        has not answered for a while."""
        delay = backoff.next()
        log.warning("%s; retrying in %.1f s", error, delay)
        silent = time.monotonic() - self.last_answer
        if silent > UNREACHABLE_SAY and time.monotonic() - self.said_unreachable > UNREACHABLE_SAY:
            self.said_unreachable = time.monotonic()
            console.print(f"[yellow]cannot reach the coordinator at {escape(self.config.address)} for "
                          f"{silent / 60:.0f} min[/] ({escape(str(error))}); still trying: this node picks up "
                          "again when the coordinator is back")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), delay)

    async def _finish(self, version: int) -> None:
        """Leave with the run's final policy if it can still be fetched; the run is over either way."""
        try:
            await self._bring_to(version)
        except (UpdateError, TransportError, ProtocolError) as e:
            console.print(f"the run is finished at version {version}; this node stays at version {self.version} "
                          f"(the final update could not be fetched: {e})")
            return
        console.print(f"the run is finished at version {version}")

    async def _request_lease(self) -> TaskLease | NoWork:
        request = sign_message(LeaseRequest(
            run_id=self.manifest.run_id, node_key=self.node_key, peer_id=self.endpoint.peer_id, name=self.name,
            version=self.version, max_seeds=64 if self.accepted else FIRST_LEASE_SEEDS, time=time.time(),
            backend=self.backend.name,
        ), self.key)
        raw = await self.endpoint.call_one(self.trainer, rpc.LEASE, request.to_wire())
        return decode_one_of(raw, (TaskLease, NoWork))

    async def _prepare(self, lease: TaskLease) -> None:
        """Move to the lease's version (the trainer's newest) before sampling, in both modes: in
        async mode fresh rollouts keep staleness near one step, and the bound S is there for
        stragglers. If an async update fails, sample with what we hold while the bound admits it
        (the node-side staleness gate); sequential pull, and every evaluation, needs exactly the
        lease's version (the trainer gives evaluation leases only to nodes not past it)."""
        if lease.evaluation and lease.version < self.version:
            raise UpdateError(f"evaluation of version {lease.version}, but this node holds version {self.version}")
        try:
            await self._bring_to(lease.version)
        except UpdateError as e:
            strict = self.manifest.mode == "sequential" or lease.evaluation
            if strict or must_update(self.version, lease.version, self.manifest.staleness):
                raise
            log.warning("could not update to version %d (%s); sampling with version %d, within the bound",
                        lease.version, e, self.version)

    async def _bring_to(self, version: int) -> None:
        if version == self.version:
            return
        started = time.perf_counter()
        self._waiting(f"updating from version {self.version} to {version} ...")
        try:
            while True:
                try:
                    chain = await catch_up(self.endpoint, self.trainer, self._providers, self.manifest, self.version,
                                           version, self._apply, CALL_TIMEOUT)
                    break
                except UpdateError as e:
                    if not e.busy:
                        raise
                    # The trainer sent its copy to another node (its upload budget; it lets one more
                    # in if nobody relays): learn who holds it and retry soon, keeping our lease.
                    self.version_changed.set()
                    await asyncio.sleep(BUSY_RETRY)
        finally:
            if self.manifest.update == "full" and self.loaded != self.version:
                await asyncio.to_thread(self._load_full_weights)  # whatever verified prefix we reached
        route = " + ".join(f"{'snapshot' if s.replaces else 'delta'} {s.from_version}->{s.to_version}" for s in chain)
        self._say(f"updated to version {version} via {route} in {time.perf_counter() - started:.2f}s")

    def _providers(self, version: int) -> list[str]:
        """Peers that announced holding `version` or later; the trainer is added after them."""
        return [peer for peer, held in self.peer_versions.items() if held >= version and peer != self.endpoint.peer_id]

    async def _apply(self, update: WeightUpdate, store: dict[str, bytes], payloads: dict[str, bytes]) -> None:
        new = await asyncio.to_thread(apply_update, self.master, update, payloads)
        new = new if update.replaces else {**self.master, **new}
        if update.mode == "lora":
            await load_lora(new, update, self.backend, self.data_dir / "adapters")  # raises: nothing changed
        self.master = new
        self.version = update.to_version
        self.relay.remember(update, store)
        self.version_changed.set()

    def _load_full_weights(self) -> None:
        """Full mode: bring the backend to the master weights (after a whole chain, once)."""
        if self.config.backend == "transformers":
            self.backend.load_weights(self.master)
        else:
            out = self.data_dir / "weights" / f"v{self.version}.gguf"
            out.parent.mkdir(exist_ok=True)
            export_quantized(self.hf_config, self.master, self.model, out, self.backend.file_type)
            self.backend.reload(out)
            for old in out.parent.glob("v*.gguf"):
                if old != out:
                    old.unlink()
        self.loaded = self.version

    def _generate(self, lease: TaskLease) -> RolloutBatch:
        samples = []
        group = lease.samples if lease.evaluation else self.manifest.group_size
        for seed, prompt in zip(lease.seeds, lease.prompts):
            for j in range(group):
                if self.stop_requested.is_set():
                    raise Stopped("stopping")
                noise = None if lease.greedy else sampling.sample_seed(lease.lease_id, seed, j)  # None: greedy
                samples.append(self._sample(seed, prompt, noise))
        batch = RolloutBatch(
            run_id=self.manifest.run_id, lease_id=lease.lease_id, version=self.version, node_key=self.node_key,
            samples=tuple(samples), created=time.time(),
        )
        return sign_message(batch, self.key)

    def _sample(self, seed: int, prompt: tuple[int, ...], sample_seed: int | None) -> RolloutSample:
        m = self.manifest
        if self.task is not None:
            return play(self.backend, self.task.episode(seed), seed, prompt, m.turns, m.task.max_turns, m.max_new_tokens,
                        m.temperature, sample_seed)
        out = self.backend.generate(list(prompt), m.max_new_tokens, m.temperature, sample_seed)
        return RolloutSample(seed=seed, prompt_ids=prompt, completion_ids=out.token_ids, logprobs=out.logprobs)

    async def _push(self, batch: RolloutBatch, expires_at: float) -> PushReceipt:
        """Push until the trainer answers. A broken stream (the coordinator restarting, say) is
        retried while the lease lasts: a restarted coordinator still knows the lease, and what
        it acknowledges it keeps. A refusal is final."""
        backoff = Backoff()
        while True:
            try:
                raw = await self.endpoint.call_one(self.trainer, rpc.PUSH, batch.to_wire())
                self.last_answer = time.monotonic()
                return PushReceipt.from_wire(raw)
            except RemoteError:
                raise  # the trainer answered: stale, released, refused. Pushing again cannot change that.
            except TransportError as e:
                delay = backoff.next()
                if time.time() + delay >= expires_at:
                    raise
                log.warning("pushing lease %s failed (%s); retrying in %.1f s while the lease lasts",
                            batch.lease_id, e, delay)
                await asyncio.sleep(delay)
