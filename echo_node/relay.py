"""Peer relay: a node serves the updates it has verified and applied, so the trainer uploads
each version about once however many nodes join. What a node relays is exactly what it checked
(signed manifest, hashed chunks), and receivers check it all again: relaying adds no trust.
"""

from __future__ import annotations

from protocols.messages import Chunk, ChunkRequest, UpdateIndex, UpdateInfo, UpdateRequest, WeightUpdate

HANDLER_TIMEOUT = 120.0


class Relay:
    def __init__(self, keep_versions: int = 2):
        self.keep_versions = keep_versions
        self.updates: dict[tuple[int, int], tuple[WeightUpdate, dict[str, bytes]]] = {}
        self.bytes_served = 0

    def remember(self, update: WeightUpdate, store: dict[str, bytes]) -> None:
        self.updates[update.from_version, update.to_version] = (update, store)
        latest = max(to for _, to in self.updates)
        for key in [k for k in self.updates if k[1] <= latest - self.keep_versions]:
            del self.updates[key]

    def manifest(self, from_version: int, to_version: int) -> WeightUpdate | None:
        held = self.updates.get((from_version, to_version))
        return held[0] if held else None

    def index(self) -> UpdateIndex:
        infos = tuple(UpdateInfo(u.from_version, u.to_version, sum(t.nbytes for t in u.tensors), u.replaces)
                      for u, _ in self.updates.values())
        return UpdateIndex(max((i.to_version for i in infos), default=0), infos)

    def chunk(self, digest: str) -> bytes | None:
        for _, store in self.updates.values():
            if digest in store:
                return store[digest]
        return None

    async def serve(self, endpoint) -> None:
        async def chunks(request: bytes, peer: str):
            for digest in ChunkRequest.from_wire(request).digests:
                data = self.chunk(digest)
                if data is not None:
                    self.bytes_served += len(data)
                    yield Chunk(digest, data).to_wire()

        async def update(request: bytes, peer: str):
            r = UpdateRequest.from_wire(request)
            found = self.manifest(r.from_version, r.to_version)
            if found is not None:
                yield found.to_wire()

        async def updates(request: bytes, peer: str):
            yield self.index().to_wire()

        await endpoint.serve("echo.chunks", chunks, 1024 * 1024, HANDLER_TIMEOUT)
        await endpoint.serve("echo.update", update, 1024, HANDLER_TIMEOUT)
        await endpoint.serve("echo.updates", updates, 1024, HANDLER_TIMEOUT)
