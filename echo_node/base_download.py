"""The run's base model for a node that joined without `--model`: fetched as content-addressed
chunks from the trainer and from peers that hold it, like an update's.

Trust: the chunk list (`ModelFile`) is signed by the run key and names the file's sha256, which
must equal the signed run manifest's `base_sha256`; every chunk is checked against its digest as
it arrives, and the whole file against its sha256 before it is used. Resumable: chunks land in
`SHA.gguf.partial` at their offsets, and a restart re-hashes what is there and fetches only what
is missing or wrong. The finished file is kept as `SHA.gguf` in the node's data dir, so a later
join of any run with the same base starts at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from echo_node.disk import Disk, touch
from echo_node.updates import Shunned, UpdateError, fetch_chunks
from protocols import rpc
from protocols.errors import IntegrityError
from protocols.messages import ModelFile, RunManifest
from protocols.signing import sha256_file, sha256_hex, verify_message
from protocols.supervise import retry

log = logging.getLogger(__name__)

BATCH_CHUNKS = 8  # chunks fetched (and held in memory) at once: 32 MiB at the default chunk size
ATTEMPTS = 5  # fetch rounds in a row that may fail outright before the download gives up
BUSY_RETRY = 0.3  # seconds; the trainer sent its share, peers will have it in a moment
SETTLED = 2.0  # seconds since its last change before a file's hash is remembered

# (bytes done, bytes total, seconds since this session's start, bytes fetched this session) -> None
Progress = Callable[[int, int, float, int], None]


async def fetch_model_file(endpoint, provider: str, run: RunManifest, timeout: float) -> ModelFile:
    """The signed chunk list of the run's base model, checked against the run manifest."""
    model_file = await endpoint.call_one(provider, rpc.BASE, idempotent=True, timeout=timeout)
    verify_message(model_file, run.run_key)
    if (model_file.run_id, model_file.sha256) != (run.run_id, run.base_sha256):
        raise UpdateError(f"the base model list names run {model_file.run_id} / sha256 {model_file.sha256[:12]}, "
                          f"not this run's base {run.base_sha256[:12]}")
    return model_file


def known_sha256(path: Path, directory: Path) -> str:
    """The file's sha256, remembered in `directory/hashes.json` by path, size and modification
    time: a rejoin does not read a multi-GB model again. A changed file is hashed afresh. As in
    git's racy-clean rule, a file modified within SETTLED seconds of hashing is not remembered:
    a write in the same timestamp tick would leave its modification time unchanged."""
    import json

    stat, book = path.stat(), directory / "hashes.json"
    key, stamp = str(path.resolve()), [stat.st_size, stat.st_mtime_ns]
    try:
        known = json.loads(book.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key) if isinstance(known, dict) else None
    if isinstance(entry, list) and len(entry) == 3 and entry[:2] == stamp and isinstance(entry[2], str):
        return entry[2]
    digest = sha256_file(path)
    if time.time() - stat.st_mtime < SETTLED:
        return digest
    known = {**(known if isinstance(known, dict) else {}), key: [*stamp, digest]}
    directory.mkdir(parents=True, exist_ok=True)
    tmp = book.with_name(book.name + ".tmp")
    tmp.write_text(json.dumps(known))
    tmp.replace(book)
    return digest


def held_chunks(path: Path, model_file: ModelFile) -> set[int]:
    """Indices of the chunks `path` already holds correctly (a partial download)."""
    if not path.is_file():
        return set()
    held = set()
    with path.open("rb") as f:
        for i, digest in enumerate(model_file.chunks):
            offset, length = model_file.span(i)
            f.seek(offset)
            if sha256_hex(f.read(length)) == digest:
                held.add(i)
    return held


async def download(endpoint, trainer: str, peers: Callable[[], Awaitable[list[str]]], model_file: ModelFile,
                   disk: Disk, progress: Progress, timeout: float) -> tuple[Path, Counter]:
    """The base model at `models/SHA.gguf` in the node's data dir, and the bytes each provider
    sent this time. The size is the coordinator's word (it may say 512 GiB): `disk` makes room,
    or refuses, before a byte is written."""
    directory = disk.root / "models"
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{model_file.sha256}.gguf"
    partial = final.with_name(final.name + ".partial")
    if final.is_file():
        if await asyncio.to_thread(known_sha256, final, directory) == model_file.sha256:
            touch(final)
            return final, Counter()
        log.warning("the cached base model %s is damaged; repairing it", final.name)
        final.replace(partial)
    disk.make_room(model_file.size, "the base model", replacing=partial)
    held = await asyncio.to_thread(held_chunks, partial, model_file)
    missing = [i for i in range(len(model_file.chunks)) if i not in held]
    done = sum(model_file.span(i)[1] for i in held)
    sources: Counter = Counter()
    shunned = Shunned()  # across batches: a peer that failed one is not asked for the next
    started = time.monotonic()
    progress(done, model_file.size, 0.0, 0)
    with partial.open("r+b" if partial.exists() else "w+b") as f:
        f.truncate(model_file.size)
        for start in range(0, len(missing), BATCH_CHUNKS):
            batch = missing[start : start + BATCH_CHUNKS]
            store = await _fetch(endpoint, trainer, peers, [model_file.chunks[i] for i in batch], timeout, sources,
                                 shunned)
            for i in batch:
                offset, length = model_file.span(i)
                f.seek(offset)
                f.write(store[model_file.chunks[i]])
                done += length
            progress(done, model_file.size, time.monotonic() - started, sum(sources.values()))
        f.flush()
        os.fsync(f.fileno())
    if await asyncio.to_thread(sha256_file, partial) != model_file.sha256:
        partial.unlink()  # every chunk checked out, so the list itself was wrong: start over
        raise IntegrityError(f"the assembled base model does not hash to {model_file.sha256[:12]}")
    partial.replace(final)
    touch(final)
    return final, sources


async def _fetch(endpoint, trainer: str, peers, digests: list[str], timeout: float, sources: Counter,
                 shunned: Shunned) -> dict[str, bytes]:
    """One batch of chunks from peers and the trainer; "busy" (the trainer sent its share) is
    retried at once with fresh peers, other failures with backoff, ATTEMPTS times."""
    failures = 0

    async def attempt() -> dict[str, bytes]:
        return await fetch_chunks(endpoint, await peers(), trainer, list(dict.fromkeys(digests)), timeout, sources,
                                  shunned)

    def give_up(error: BaseException, delay: float) -> bool:
        nonlocal failures
        if error.busy:
            return False
        failures += 1
        return failures >= ATTEMPTS

    async def wait(error: BaseException, delay: float) -> None:
        if error.busy:
            shunned.forgive()
        else:
            log.info("base model chunks unavailable (%s); retrying", error)
        await asyncio.sleep(delay)

    return await retry(attempt, UpdateError, busy=lambda e: e.busy, busy_delay=BUSY_RETRY, give_up=give_up, wait=wait)


def progress_line(done: int, total: int, seconds: float, fetched: int, width: int = 24) -> str:
    """`base model [#########-----------] 41.9/101.3 MB · 12.0 MB/s · 5 s left`"""
    filled = round(width * done / total) if total else width
    rate = fetched / seconds if seconds > 0 else 0.0
    left = f" · {(total - done) / rate:.0f} s left" if rate > 0 and done < total else ""
    return (f"base model [{'#' * filled}{'-' * (width - filled)}] {done / 1e6:.1f}/{total / 1e6:.1f} MB"
            f" · {rate / 1e6:.1f} MB/s{left}")
