"""Serving verified updates and the base model file: the trainer publishes through a Relay, and
every node runs one for the updates it has verified and applied and for its base model file, so
the trainer uploads each version about once however many nodes join (see `protocols.uploads`).
What a relay serves is exactly what it checked (signed manifest, hashed chunks), and receivers
check it all again: relaying adds no trust.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from protocols import rpc
from protocols.errors import ProtocolError
from protocols.messages import Chunk, ChunkRequest, ModelFile, UpdateIndex, UpdateInfo, UpdateRequest, WeightUpdate
from protocols.uploads import ByteQuota, UploadBudget


class Busy(ProtocolError):
    """This provider has sent its share of an update; fetch the rest from peers that hold it."""

    code = "busy"


BASE_KEY = "base"  # the upload budget's account for the base model file


class Relay:
    def __init__(self, keep_versions: int = 2, budget: UploadBudget | None = None,
                 peers_holding: Callable[[int], int] = lambda version: 0, quota: ByteQuota | None = None):
        """`budget`: limit on what this relay uploads per update (the trainer's); None = no limit.
        `peers_holding(version)`: how many other peers say they hold `version`. `quota`: the
        bytes it uploads in all (a volunteer's); None = no limit."""
        self.keep_versions, self.budget, self.peers_holding = keep_versions, budget, peers_holding
        self.quota = quota
        self.updates: dict[tuple[int, int], tuple[WeightUpdate, dict[str, bytes]]] = {}
        self.bytes_served = 0
        self.base: tuple[ModelFile, Path] | None = None  # the base model file and where it lies
        self._base_spans: dict[str, tuple[int, int]] = {}  # chunk digest -> (offset, length) in it

    def serve_file(self, manifest: ModelFile, path: Path) -> None:
        """Serve the base model file's chunks from disk. The caller checked the file's sha256
        against the signed manifest, so every chunk hashes to its digest."""
        self._base_spans = {d: manifest.span(i) for i, d in enumerate(manifest.chunks)}
        self.base = (manifest, path)
        if self.budget is not None:
            self.budget.register(BASE_KEY)

    def remember(self, update: WeightUpdate, store: dict[str, bytes]) -> None:
        """Serve `update`. Updates ending more than `keep_versions` back are forgotten, except the
        newest snapshot and the deltas after it: the chain late joiners take to the latest."""
        key = (update.from_version, update.to_version)
        # Copy, change, swap: handlers iterating the old dict on the event loop stay safe while
        # the trainer publishes from its worker thread.
        updates = {**self.updates, key: (update, store)}
        if self.budget is not None:
            self.budget.register(key)
        latest = max(to for _, to in updates)
        snapshots = [k for k, (u, _) in updates.items() if u.replaces]
        newest_snapshot = max(snapshots, key=lambda k: k[1], default=(0, 0))  # version 0: the base

        def needed(k: tuple[int, int]) -> bool:
            return k[1] > latest - self.keep_versions or k == newest_snapshot or (
                not updates[k][0].replaces and k[0] >= newest_snapshot[1])

        for old in [k for k in updates if not needed(k)]:
            del updates[old]
            if self.budget is not None:
                self.budget.forget(old)
        self.updates = updates

    @property
    def latest_version(self) -> int:
        return max((to for _, to in self.updates), default=0)

    def manifest(self, from_version: int, to_version: int) -> WeightUpdate | None:
        held = self.updates.get((from_version, to_version))
        return held[0] if held else None

    def index(self) -> UpdateIndex:
        infos = tuple(UpdateInfo(u.from_version, u.to_version, sum(t.nbytes for t in u.tensors), u.replaces)
                      for u, _ in self.updates.values())
        return UpdateIndex(self.latest_version, infos)

    def chunk(self, digest: str, peer: str = "", now: float | None = None) -> bytes | None:
        data = self._chunk(digest, peer, time.monotonic() if now is None else now)
        if data is not None:
            self.bytes_served += len(data)
        return data

    def _spend(self, length: int, now: float) -> None:
        """Take `length` bytes from this node's upload quota, before a byte is read."""
        if self.quota is not None and not self.quota.take(length, now):
            raise Busy("this node's upload budget is spent for now; fetch from others")

    def _chunk(self, digest: str, peer: str, now: float) -> bytes | None:
        for key, (update, store) in self.updates.items():
            if digest in store:
                data = store[digest]
                # Nodes that follow the run fetch the update from the version before: a peer that
                # holds version v holds the step to it, not a snapshot from further back (a late
                # joiner's). Sent to such peers, a snapshot's asker would wait the budget's whole
                # patience (30 s); the trainer lets one in every `grace` instead.
                late_joiners_only = update.replaces and key[0] < key[1] - 1
                holders = 0 if late_joiners_only else self.peers_holding(key[1])
                if self.budget is not None and not self.budget.allow(key, peer, now, holders):
                    raise Busy(f"sent its share of update {key[0]}->{key[1]}; fetch from peers holding it")
                self._spend(len(data), now)
                return data
        if digest in self._base_spans:
            # Every node that holds any version holds the base: count them as holders of version 0.
            if self.budget is not None and not self.budget.allow(BASE_KEY, peer, now, self.peers_holding(0)):
                raise Busy("sent its share of the base model; fetch from peers holding it")
            offset, length = self._base_spans[digest]
            self._spend(length, now)
            with self.base[1].open("rb") as f:  # a page-cache read, ~1 ms for 4 MiB
                f.seek(offset)
                data = f.read(length)
            return data
        return None

    async def serve(self, endpoint) -> None:
        async def chunks(request: ChunkRequest, peer: str):
            # A digest named twice is served once: a request costs at most its distinct chunks.
            for digest in dict.fromkeys(request.digests):
                data = self.chunk(digest, peer)
                if data is not None:
                    yield Chunk(digest, data)

        async def update(request: UpdateRequest, peer: str):
            found = self.manifest(request.from_version, request.to_version)
            if found is not None:
                yield found

        async def updates(request: None, peer: str):
            yield self.index()

        async def base(request: None, peer: str):
            if self.base is not None:
                yield self.base[0]

        await endpoint.serve(rpc.CHUNKS, chunks)
        await endpoint.serve(rpc.UPDATE, update)
        await endpoint.serve(rpc.UPDATES, updates)
        await endpoint.serve(rpc.BASE, base)
