"""Reaching a version: plan the cheapest chain of updates, then fetch, verify and apply each.

Nothing is applied until it is checked: the manifest's signature against the pinned run key,
its run, its step and kind against the plan, every chunk's sha256, every payload against its
tensor's shape and encoding. Any failure raises `UpdateError` and leaves the node on the last
version it fully applied, still serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import numpy as np

from echo_node.disk import Disk
from engines.gguf_io import write_lora_adapter
from protocols import catchup, chunks, delta, rpc
from protocols.errors import CodecError, EchoError, ProtocolError, TransportError
from protocols.messages import Chunk, ChunkRequest, RunManifest, UpdateIndex, UpdateRequest, WeightUpdate
from protocols.signing import verify_message

log = logging.getLogger(__name__)


# Applies one verified update: (manifest, chunks by digest, payload bytes per tensor name) -> None.
Applier = Callable[[WeightUpdate, dict[str, bytes], Mapping[str, bytes]], Awaitable[None]]
# Checks a verified manifest against the weights it would apply to, before its chunks are fetched.
Checker = Callable[[WeightUpdate], None]


class UpdateError(EchoError):
    """An update could not be fetched or verified; the node stays on its old version. `busy`:
    the only refusal was the trainer's upload budget, so peers will have it in a moment."""

    def __init__(self, message: str, busy: bool = False):
        super().__init__(message)
        self.busy = busy


async def fetch_index(endpoint, provider: str, timeout: float) -> UpdateIndex:
    return await endpoint.call_one(provider, rpc.UPDATES, idempotent=True, timeout=timeout)


async def fetch_manifest(endpoint, provider: str, run: RunManifest, step: catchup.Step, timeout: float) -> WeightUpdate:
    request = UpdateRequest(step.from_version, step.to_version)
    update = await endpoint.call_one(provider, rpc.UPDATE, request, idempotent=True, timeout=timeout)
    verify_message(update, run.run_key)  # before any chunk is fetched
    wanted = (run.run_id, step.from_version, step.to_version, step.replaces, run.update)
    got = (update.run_id, update.from_version, update.to_version, update.replaces, update.mode)
    if got != wanted:
        # A validly signed manifest for another step: a replayed or misfiled update.
        raise UpdateError(f"asked for update {wanted}, got {got}")
    return update


class Stalled(TransportError):
    """A provider sent none of the chunks it was asked for in `STALL_SECONDS`: it sat on them."""


STALL_SECONDS = 10.0  # a provider that sends no chunk for this long is given up on
SHUN_SECONDS = 600.0  # and not asked again for this long (it lied, or it is gone)
PEERS_AT_ONCE = 8  # named holders asked in one fetch: a round of silent ones costs one stall


class Shunned:
    """Providers that failed us (withheld, corrupted, stalled, broke the stream), remembered
    between fetches: holding a version is only a node's claim, and a peer that claims every version and
    serves nothing must not be asked first every time. "busy" (the trainer's upload budget) is
    not a failure."""

    def __init__(self, seconds: float = SHUN_SECONDS):
        self.seconds = seconds
        self.until: dict[str, tuple[float, bool]] = {}  # provider -> (shunned until, whether it lied)

    def add(self, provider: str, lied: bool = True) -> None:
        """`lied`: it withheld, corrupted or sat on what it was asked for; else its stream broke."""
        self.until[provider] = (time.monotonic() + self.seconds, lied)

    def forgive(self) -> None:
        """The trainer says peers hold what we want ("busy"; it counts only peers that work for
        the run): a broken stream may have been a moment's, a relay circuit being set up. A peer
        that withheld, corrupted or stalled is not forgiven: "busy" is no news of it, and a claimant
        forgiven at every "busy" cost a stall on every try (issue 55 point 2)."""
        self.until = {p: (t, lied) for p, (t, lied) in self.until.items() if lied}

    def filter(self, providers: list[str]) -> list[str]:
        now = time.monotonic()
        self.until = {p: (t, lied) for p, (t, lied) in self.until.items() if t > now}
        return [p for p in providers if p not in self.until]


async def fetch_chunks(endpoint, peers: list[str], trainer: str, digests: list[str], timeout: float,
                       sources: Counter | None = None, shunned: Shunned | None = None,
                       stall: float | None = None) -> dict[str, bytes]:
    """Verified chunk bytes by digest, fetched in parallel from the trainer and up to
    PEERS_AT_ONCE of `peers` (claimed holders, less those `shunned`), drawn at random: a
    holder's claim is free to make, so no claim puts a peer first. The trainer is first in every
    round, so it has a share even of an update of fewer chunks than providers (it answers "busy"
    once its upload budget is spent). Digests a provider withholds,
    corrupts, refuses ("busy"), loses mid-stream or sits on for `stall` seconds are asked of the
    others; chunks received before a failure are kept. Raises UpdateError only when every
    provider failed. `sources`, if given, counts the bytes each provider sent; `shunned`, if
    given, is skipped and learns which peers failed (never the trainer: it is the source)."""
    found: dict[str, bytes] = {}
    shunned, stall = shunned or Shunned(), STALL_SECONDS if stall is None else stall
    candidates = shunned.filter([p for p in dict.fromkeys(peers) if p != trainer])
    providers = [trainer, *random.sample(candidates, min(len(candidates), PEERS_AT_ONCE))]
    remaining, live, busy = list(digests), list(providers), False
    while remaining and live:
        shares = {p: remaining[i :: len(live)] for i, p in enumerate(live)}
        results = await asyncio.gather(*(_fetch_from(endpoint, p, share, timeout, found, sources, stall)
                                         for p, share in shares.items()), return_exceptions=True)
        for provider, result in zip(shares, results):
            lied = True
            if isinstance(result, (ProtocolError, TransportError)):
                log.info("provider %s failed: %s", provider[-8:], result)
                refused_busy = getattr(result, "code", None) == "busy"
                busy, shun = busy or refused_busy, not refused_busy
                lied = not isinstance(result, TransportError) or isinstance(result, Stalled)
            elif isinstance(result, BaseException):
                raise result
            elif any(d not in found for d in shares[provider]):
                shun = True  # it does not hold everything it was asked for
            else:
                continue
            if shun and provider != trainer:
                shunned.add(provider, lied)
            live.remove(provider)
        remaining = [d for d in remaining if d not in found]
    if remaining:
        raise UpdateError(f"{len(remaining)} of {len(digests)} chunks unavailable from {len(providers)} providers",
                          busy=busy)
    return found


async def _fetch_from(endpoint, provider: str, digests: list[str], timeout: float, found: dict[str, bytes],
                      sources: Counter | None, stall: float) -> None:
    loop = asyncio.get_running_loop()

    async def keep(chunk: Chunk) -> None:
        # Only a wanted chunk that verifies pushes the watchdog back: chunks nobody asked for
        # kept a trickling claimant on for the whole call timeout (issue 55 point 2).
        if chunk.digest in wanted and chunk.digest not in found:
            found[chunk.digest] = chunks.check(chunk.digest, chunk.data)
            if sources is not None:
                sources[provider] += len(chunk.data)
            watchdog.reschedule(loop.time() + stall)

    step = rpc.MAX_CHUNKS_PER_REQUEST
    for i in range(0, len(digests), step):
        wanted = set(digests[i : i + step])
        request = ChunkRequest(tuple(digests[i : i + step]))
        try:
            async with asyncio.timeout(stall) as watchdog:  # pushed back by every wanted chunk (`keep`)
                await endpoint.call(provider, rpc.CHUNKS, request, on_reply=keep, timeout=timeout)
        except TimeoutError:
            raise Stalled(f"provider {provider[-8:]} sent no chunk it was asked for in {stall:.0f} s") from None


async def catch_up(endpoint, trainer: str, peers: Callable[[int], Awaitable[list[str]]], run: RunManifest, held: int, target: int,
                   apply: Applier, timeout: float, shunned: Shunned | None = None,
                   check: Checker | None = None) -> list[catchup.Step]:
    """Bring the node from `held` to `target`, one verified update at a time, and return the chain
    taken. Manifests come from the trainer; chunks from `await peers(version)` (nodes said
    to hold it, less those `shunned`) and the trainer, once `check` has passed the manifest."""
    try:
        index = await fetch_index(endpoint, trainer, timeout)
        offered = [catchup.Step(u.from_version, u.to_version, u.nbytes, u.replaces) for u in index.updates]
        chain = catchup.plan(held, target, offered)
        for step in chain:
            update = await fetch_manifest(endpoint, trainer, run, step, timeout)
            if check is not None:
                check(update)
            digests = list(dict.fromkeys(d for t in update.tensors for d in t.chunks))
            store = await fetch_chunks(endpoint, await peers(step.to_version), trainer, digests, timeout, shunned=shunned)
            await apply(update, store, Payloads(update, store))  # the applier records the new version
            held = update.to_version
    except UpdateError as e:
        raise UpdateError(f"update to version {target} stopped at version {held}: {e}", busy=e.busy) from None
    except (ProtocolError, TransportError, ValueError) as e:
        # ValueError: tensor names that are no weights of this model, or a backend refusing a file.
        raise UpdateError(f"update to version {target} stopped at version {held}: {e}") from None
    return chain


def check_manifest(held: Mapping[str, tuple[int, ...]], update: WeightUpdate, max_elements: int | None) -> None:
    """What a signed manifest says, checked before one chunk is fetched: its sizes are the
    coordinator's word, and a few bytes of manifest may declare gigabytes to download and hold.
    `held` is the shape of every tensor updates apply to (none before the first LoRA snapshot).
    Names and shapes must be those held; each payload's size at most what its encoding can take
    for its shape; a first LoRA snapshot's values at most `max_elements` (the base model's
    parameter count); a snapshot covers every tensor held."""
    where = f"update {update.to_version}"
    if not held and not update.replaces:
        raise CodecError(f"{where} is a delta, but there is nothing to apply it to")
    declared = 0
    for t in update.tensors:
        if held and t.name not in held:
            raise CodecError(f"{where} names tensor {t.name!r}, which this model does not have")
        if held and tuple(t.shape) != held[t.name]:
            raise CodecError(f"{where}: tensor {t.name!r} has shape {tuple(t.shape)}, this model's is {held[t.name]}")
        most = delta.max_payload_bytes(t.shape, t.encoding, f"{where}: tensor {t.name!r}")
        if t.nbytes > most:
            raise CodecError(f"{where}: tensor {t.name!r} declares {t.nbytes:,} payload bytes, "
                             f"{t.encoding} of shape {tuple(t.shape)} takes at most {most:,}")
        declared += math.prod(t.shape)
    if not held and max_elements is not None and declared > max_elements:
        raise CodecError(f"{where} declares {declared:,} values, more than the base model's {max_elements:,} parameters")
    if update.replaces and held and len(update.tensors) != len(held):
        raise CodecError(f"snapshot {update.to_version} lacks {len(held) - len(update.tensors)} tensors")


def shapes(weights: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(w.shape) for name, w in weights.items()}


def apply_update(held: dict[str, np.ndarray], update: WeightUpdate, payloads: Mapping[str, bytes],
                 max_elements: int | None = None,
                 held_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """The weights after `update` (checked again by `check_manifest`, for callers that did not
    fetch it): the whole new dict for a snapshot, else the tensors it touches. `held` itself is
    not modified, so a failure part-way leaves nothing half-applied. The first LoRA snapshot
    (nothing held yet) defines the tensors, and the backend checks the names when it loads the
    adapter. LoRA views are bf16 (`protocols.delta`). A snapshot reads nothing of `held`: a
    caller that does not hold the weights it replaces passes their `held_shapes` instead."""
    check_manifest(shapes(held) if held_shapes is None else held_shapes, update, max_elements)
    new = {}
    for t in update.tensors:
        if update.replaces:
            new[t.name] = delta.decode(payloads[t.name], t.encoding, t.shape, name=t.name)
        else:
            new[t.name] = delta.apply(held[t.name], payloads[t.name], t.encoding, name=t.name,
                                      bf16=update.mode == "lora")
    return new


class Payloads(Mapping):
    """Each tensor's payload, assembled from verified chunks when read: a full-mode snapshot is
    held once as chunks (which the node serves on), not a second time as payloads."""

    def __init__(self, update: WeightUpdate, store: Mapping[str, bytes]):
        self.entries, self.store = {t.name: t for t in update.tensors}, store

    def __getitem__(self, name: str) -> bytes:
        return chunks.assemble(self.entries[name], self.store.__getitem__)

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


async def load_lora(adapter: dict[str, np.ndarray], update: WeightUpdate, backend, disk: Disk) -> Path:
    """LoRA mode: write the adapter nodes now hold as a GGUF adapter (float32, in the data dir's
    `adapters`, room made first) and hot-swap it in."""
    alpha = update.params.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise UpdateError(f"update {update.to_version} carries no positive LoRA alpha")
    adapter_dir = disk.root / "adapters"
    adapter_dir.mkdir(parents=True, exist_ok=True)
    path = adapter_dir / f"v{update.to_version}.gguf"
    disk.make_room(4 * sum(a.size for a in adapter.values()), f"update {update.to_version}'s LoRA adapter",
                   keep=[backend.model_path] if getattr(backend, "model_path", None) else [])
    try:
        await asyncio.to_thread(write_lora_adapter, adapter, float(alpha), path, backend.layout)
        await asyncio.to_thread(backend.set_adapter, path)
    except BaseException:
        path.unlink(missing_ok=True)  # an adapter llama.cpp (or the writer) refused is no use on disk
        raise
    for old in adapter_dir.glob("v*.gguf"):  # llama.cpp holds the adapter in memory: one file is enough
        if old != path:
            old.unlink(missing_ok=True)
    return path
