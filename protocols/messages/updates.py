"""Weight updates and the base model file: signed manifests of content-addressed chunks, and how
nodes ask for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocols.errors import InvalidValue, MalformedMessage
from protocols.messages.run import UPDATE_MODES
from protocols.wire import Fields, WireMessage

MAX_TENSORS = 20_000  # per WeightUpdate
MAX_CHUNK_BYTES = 8 * 2**20
MAX_CHUNKS_PER_REQUEST = 64  # chunks one ChunkRequest may name: at most 512 MiB of replies
MAX_FILE_CHUNKS = 2**16  # a ModelFile's chunks: 256 GiB at the default 4 MiB


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a WeightUpdate: its payload is split into chunks addressed by sha256."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # dtype of the weights the payload updates, e.g. "float32"
    encoding: str  # delta codec encoding, e.g. "dense-fp32", "topk-int8"
    nbytes: int  # payload size; every chunk but the last is exactly the update's chunk_size
    chunks: tuple[str, ...]  # sha256 hex of each chunk, in order

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "shape": list(self.shape), "dtype": self.dtype, "encoding": self.encoding,
            "nbytes": self.nbytes, "chunks": list(self.chunks),
        }

    @classmethod
    def from_dict(cls, body: Any, where: str, chunk_size: int) -> TensorEntry:
        f = Fields(body, where)
        shape = tuple(f.integers("shape", 8, 0, 2**31))
        nbytes = f.integer("nbytes", 0, 2**40)
        chunks = tuple(f.sha256s("chunks", 2**20))
        if len(chunks) != -(-nbytes // chunk_size):
            raise InvalidValue(f"{where}: {len(chunks)} chunks cannot hold {nbytes} bytes at {chunk_size} per chunk")
        return cls(
            name=f.text("name"), shape=shape, dtype=f.text("dtype", 16), encoding=f.text("encoding", 32),
            nbytes=nbytes, chunks=chunks,
        )


@dataclass(frozen=True)
class WeightUpdate(WireMessage):
    """Manifest of the step from `from_version` to `to_version`, signed by the run key. Nodes
    verify it before fetching any chunk."""

    KIND = "weight_update"
    MAX_BYTES = 16 * 2**20

    run_id: str
    from_version: int
    to_version: int
    mode: str  # one of UPDATE_MODES
    tensors: tuple[TensorEntry, ...]
    chunk_size: int
    replaces: bool = False  # True: payloads are the weights themselves (snapshot, LoRA adapter), not deltas
    params: dict[str, Any] = field(default_factory=dict)  # e.g. LoRA alpha
    created: float = 0.0
    signature: bytes = b""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "from_version": self.from_version, "to_version": self.to_version,
            "mode": self.mode, "tensors": [t.to_dict() for t in self.tensors], "chunk_size": self.chunk_size,
            "replaces": self.replaces,
            "params": dict(self.params), "created": self.created, "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> WeightUpdate:
        f = Fields(body, cls.KIND)
        from_version, to_version = f.integer("from_version"), f.integer("to_version")
        if to_version <= from_version:
            raise InvalidValue(f"{cls.KIND}: to_version {to_version} is not after from_version {from_version}")
        chunk_size = f.integer("chunk_size", 1, MAX_CHUNK_BYTES)
        tensors = tuple(
            TensorEntry.from_dict(t, f"{cls.KIND}.tensors[{i}]", chunk_size)
            for i, t in enumerate(f.items("tensors", MAX_TENSORS))
        )
        if len({t.name for t in tensors}) != len(tensors):
            raise InvalidValue(f"{cls.KIND}: duplicate tensor names")
        return cls(
            run_id=f.text("run_id"), from_version=from_version, to_version=to_version,
            mode=f.text("mode", choices=UPDATE_MODES), tensors=tensors, chunk_size=chunk_size, replaces=f.flag("replaces"),
            params=f.params("params"), created=f.number("created", 0.0), signature=f.signature(),
        )


@dataclass(frozen=True)
class ModelFile(WireMessage):
    """The run's base model file (the GGUF nodes run at version 0) as content-addressed chunks,
    signed by the run key; its sha256 is the RunManifest's `base_sha256`. Nodes without the file
    fetch the chunks from the trainer and from peers that hold it, checking each against this list."""

    KIND = "model_file"
    MAX_BYTES = 4 * 2**20 + 4096

    run_id: str
    name: str  # file name, for people: the hash is what counts
    sha256: str  # of the whole file
    size: int
    chunk_size: int  # every chunk but the last is exactly this long
    chunks: tuple[str, ...]  # sha256 hex of each chunk, in file order
    signature: bytes = b""

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "name": self.name, "sha256": self.sha256, "size": self.size,
                "chunk_size": self.chunk_size, "chunks": list(self.chunks), "signature": self.signature}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ModelFile:
        f = Fields(body, cls.KIND)
        size, chunk_size = f.integer("size", 1, 2**48), f.integer("chunk_size", 1, MAX_CHUNK_BYTES)
        chunks = tuple(f.sha256s("chunks", MAX_FILE_CHUNKS))
        if len(chunks) != -(-size // chunk_size):
            raise InvalidValue(f"{cls.KIND}: {len(chunks)} chunks cannot hold {size} bytes at {chunk_size} per chunk")
        return cls(run_id=f.text("run_id"), name=f.text("name", 256), sha256=f.sha256("sha256"), size=size,
                   chunk_size=chunk_size, chunks=chunks, signature=f.signature())

    def span(self, index: int) -> tuple[int, int]:
        """(offset, length) of chunk `index` in the file."""
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, self.size - offset)


@dataclass(frozen=True)
class UpdateRequest(WireMessage):
    """Ask a provider for the WeightUpdate manifest of one step `from_version -> to_version`."""

    KIND = "update_request"
    MAX_BYTES = 1024

    from_version: int
    to_version: int

    def to_dict(self) -> dict[str, Any]:
        return {"from_version": self.from_version, "to_version": self.to_version}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> UpdateRequest:
        f = Fields(body, cls.KIND)
        return cls(f.integer("from_version"), f.integer("to_version"))


@dataclass(frozen=True)
class UpdateInfo:
    from_version: int
    to_version: int
    nbytes: int  # payload bytes to fetch
    replaces: bool  # a snapshot (or LoRA adapter): applies from any version


@dataclass(frozen=True)
class UpdateIndex(WireMessage):
    """Which updates a provider can serve. A hint for planning: every manifest is still verified."""

    KIND = "update_index"
    MAX_BYTES = 256 * 1024

    latest_version: int
    updates: tuple[UpdateInfo, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"latest_version": self.latest_version,
                "updates": [[u.from_version, u.to_version, u.nbytes, u.replaces] for u in self.updates]}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> UpdateIndex:
        f = Fields(body, cls.KIND)
        updates = []
        for i, raw in enumerate(f.items("updates", 8192)):
            if not (isinstance(raw, list) and len(raw) == 4):
                raise MalformedMessage(f"{cls.KIND}.updates[{i}]: expected [from, to, nbytes, replaces]")
            u = Fields(dict(zip(("from", "to", "nbytes", "replaces"), raw)), f"{cls.KIND}.updates[{i}]")
            updates.append(UpdateInfo(u.integer("from"), u.integer("to"), u.integer("nbytes"), u.flag("replaces")))
        return cls(f.integer("latest_version"), tuple(updates))


@dataclass(frozen=True)
class ChunkRequest(WireMessage):
    """Ask a provider for chunks by digest; it streams back one Chunk per digest it holds."""

    KIND = "chunk_request"
    MAX_BYTES = 16 * 1024

    digests: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"digests": list(self.digests)}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ChunkRequest:
        f = Fields(body, cls.KIND)
        return cls(tuple(f.sha256s("digests", MAX_CHUNKS_PER_REQUEST)))


@dataclass(frozen=True)
class Chunk(WireMessage):
    """A content-addressed piece of a tensor payload. Receivers check sha256(data) == digest."""

    KIND = "chunk"
    MAX_BYTES = MAX_CHUNK_BYTES + 1024

    digest: str
    data: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "data": self.data}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Chunk:
        f = Fields(body, cls.KIND)
        return cls(digest=f.sha256("digest"), data=f.blob("data", MAX_CHUNK_BYTES))
