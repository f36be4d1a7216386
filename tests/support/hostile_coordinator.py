"""A coordinator that signs whatever it likes: a real DHT peer and streams on 127.0.0.1 serving a
run manifest, a base-model list and leases of the test's choosing, signed by its own run key. What
a volunteer who pasted a malicious join line is up against; the tests run a real node against it."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

from protocols import rpc
from protocols.messages import LeaseRequest, ModelFile, NoWork, RunManifest, TaskLease, TaskSpec, TurnFormat
from protocols.signing import fingerprint, generate_key, public_bytes, sha256_hex, sign_message
from protocols.transport.dht import SwarmDHT

VENV_BIN = Path(sys.executable).parent


class HostileCoordinator:
    """`async with HostileCoordinator(task=..., size=...) as c:` then `await c.join(tmp_path, ...)`."""

    def __init__(self, task: TaskSpec = TaskSpec("arithmetic"), size: int = 10_000, base_sha256: str = "ab" * 32,
                 lease: Callable[[LeaseRequest], TaskLease | NoWork] | None = None, model: Path | None = None):
        """`model`: a real base model file to list, chunk by chunk (a node given it with `--model`
        serves it to peers); otherwise a list of `size` bytes of made-up chunks."""
        self.key = generate_key()
        self.task, self.size, self.base_sha256, self.lease, self.model = task, size, base_sha256, lease, model
        self.requests: list[LeaseRequest] = []

    async def __aenter__(self) -> HostileCoordinator:
        self.dht = SwarmDHT.start("127.0.0.1", 0, [])
        endpoint = await self.dht.endpoint()
        self.address = next(a for a in self.dht.addresses() if "/p2p/" in a)
        run_key = public_bytes(self.key)
        if self.model is not None:  # its real chunk list
            from echo_coordinator.base_model import model_file

            self.listed = model_file(self.model, "hostile", self.key)
            self.base_sha256 = self.listed.sha256
        else:
            chunk = 8 * 2**20  # the largest: a 400 GiB list still fits one reply
            self.listed = sign_message(ModelFile(
                run_id="hostile", name="base.gguf", sha256=self.base_sha256, size=self.size, chunk_size=chunk,
                chunks=(sha256_hex(b"x"),) * -(-self.size // chunk)), self.key)
        manifest = sign_message(RunManifest(
            run_id="hostile", base_model="base.gguf", base_sha256=self.base_sha256, vocab_size=1000,
            mode="sequential", update="lora", staleness=1, task=self.task, group_size=2, max_new_tokens=8,
            temperature=1.0, run_key=run_key, trainer_addrs=(self.address,), update_params={"rank": 2, "alpha": 4.0},
            turns=TurnFormat("\nuser: ", "\nassistant: ", "\n")), self.key)
        self.served = {"manifest": 0, "base": 0}

        async def answer(what: str, wire: bytes):
            self.served[what] += 1
            yield wire

        await endpoint.serve(rpc.MANIFEST, lambda request, peer: answer("manifest", manifest.to_wire()))
        await endpoint.serve(rpc.BASE, lambda request, peer: answer("base", self.listed.to_wire()))

        async def lease(request: LeaseRequest, peer: str):
            self.requests.append(request)
            yield self.lease(request)

        if self.lease is not None:
            await endpoint.serve(rpc.LEASE, lease)
        return self

    async def __aexit__(self, *exc) -> None:
        self.dht.shutdown()

    async def join(self, data_dir: Path, *flags: str, timeout: float = 60.0) -> tuple[int, str]:
        """A real `echo-node join` against this coordinator: its exit code and output."""
        proc = await asyncio.create_subprocess_exec(
            str(VENV_BIN / "echo-node"), "join", self.address, "--run-key", fingerprint(public_bytes(self.key)),
            "--data-dir", str(data_dir), "--threads", "1", *flags,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "COLUMNS": "300"})
        output, _ = await asyncio.wait_for(proc.communicate(), timeout)
        return proc.returncode, output.decode()
