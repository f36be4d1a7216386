"""Fetching, verifying and applying a weight update. Nothing is applied until everything checked:
the manifest's signature against the pinned run key, its run and version, every chunk's sha256,
every tensor's payload against its shape and encoding. Any failure raises `UpdateError` and
leaves the backend on the version it had.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from echo_node.gguf_io import write_lora_adapter
from protocols import chunks, delta
from protocols.errors import EchoError, ProtocolError
from protocols.messages import Chunk, ChunkRequest, RunManifest, UpdateRequest, WeightUpdate
from protocols.signing import verify_message

CHUNKS_PER_CALL = 64


class UpdateError(EchoError):
    """An update could not be fetched or verified; the node stays on its old version."""


async def fetch_update_manifest(endpoint, provider: str, manifest: RunManifest, version: int, timeout: float) -> WeightUpdate:
    raw = await endpoint.call_one(provider, "echo.update", UpdateRequest(version).to_wire(), timeout, WeightUpdate.MAX_BYTES)
    update = WeightUpdate.from_wire(raw)
    verify_message(update, manifest.run_key)  # before any chunk is fetched
    if update.run_id != manifest.run_id or update.to_version != version or update.mode != manifest.update:
        raise UpdateError(
            f"update {update.run_id}:{update.from_version}->{update.to_version} ({update.mode}) is not the "
            f"requested {manifest.run_id} version {version} ({manifest.update})"
        )
    return update


async def fetch_chunks(endpoint, provider: str, digests: list[str], timeout: float) -> dict[str, bytes]:
    """Verified chunk bytes by digest; raises UpdateError if the provider withholds any."""
    found: dict[str, bytes] = {}
    for i in range(0, len(digests), CHUNKS_PER_CALL):
        wanted = digests[i : i + CHUNKS_PER_CALL]
        for raw in await endpoint.call(provider, "echo.chunks", ChunkRequest(tuple(wanted)).to_wire(), timeout,
                                       Chunk.MAX_BYTES):
            chunk = Chunk.from_wire(raw)
            if chunk.digest in wanted:
                found[chunk.digest] = chunks.check(chunk.digest, chunk.data)
    missing = [d for d in digests if d not in found]
    if missing:
        raise UpdateError(f"provider {provider[-8:]} did not send {len(missing)} of {len(digests)} chunks")
    return found


def decode_tensors(update: WeightUpdate, store: dict[str, bytes]) -> dict[str, np.ndarray]:
    return {
        t.name: delta.decode(chunks.assemble(t, store.__getitem__), t.encoding, t.shape, name=t.name)
        for t in update.tensors
    }


async def fetch_lora_update(endpoint, provider: str, manifest: RunManifest, version: int, adapter_dir: Path, backend,
                            timeout: float) -> Path:
    """LoRA mode: fetch the adapter of `version`, write it as a GGUF adapter, hot-swap it in."""
    try:
        update = await fetch_update_manifest(endpoint, provider, manifest, version, timeout)
        digests = [d for t in update.tensors for d in t.chunks]
        store = await fetch_chunks(endpoint, provider, digests, timeout)
        tensors = decode_tensors(update, store)
        alpha = update.params.get("alpha")
        if not isinstance(alpha, (int, float)) or alpha <= 0:
            raise UpdateError(f"update {version} carries no positive LoRA alpha")
        path = adapter_dir / f"v{version}.gguf"
        await asyncio.to_thread(
            write_lora_adapter, tensors, float(alpha), path, backend.n_layers, backend.n_head, backend.n_head_kv
        )
        await asyncio.to_thread(backend.set_adapter, path)
    except (ProtocolError, ValueError) as e:
        # ValueError: tensor names that are no LoRA of this model, or llama.cpp refusing the file.
        raise UpdateError(f"update to version {version} rejected: {e}") from None
    return path
