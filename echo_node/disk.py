"""What a node may keep on disk: its data dir under the volunteer's limit (`--max-disk`).

The coordinator states the size of what a node writes: the base model (it may say 512 GiB), LoRA
adapters and, in full mode, the base's float32 checkpoint (`hf/`) and the weight exports. Each is
checked here before a byte is written, against the disk's free space (keeping `MARGIN` spare) and
against the limit on the data dir. Cached base models and checkpoints of other runs go first,
least recently used first (a base's access time is set when a node joins with it), before a
write is refused.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from protocols.errors import EchoError

MARGIN = 1 << 30  # bytes left free on the disk whatever the limit


class DiskFull(EchoError):
    """A write this node was asked to make does not fit its disk or its `--max-disk`."""


def held_bytes(path: Path) -> int:
    """Bytes a file (or a directory's files) really hold on disk (a partial download is sparse);
    0 if it is gone."""
    if path.is_dir():
        return sum(held_bytes(p) for p in path.rglob("*") if p.is_file())
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def used_at(path: Path) -> int:
    """When a cached file was last used: its access time; a checkpoint directory's is its
    `config.json`'s (listing a directory changes the directory's own)."""
    marker = path / "config.json" if path.is_dir() else path
    return (marker if marker.exists() else path).stat().st_atime_ns


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def touch(path: Path) -> None:
    """Mark a cached base model used now: its access time only (its modification time keys the
    remembered hash, `base_download.known_sha256`)."""
    stat = path.stat()
    os.utime(path, ns=(time.time_ns(), stat.st_mtime_ns))


@dataclass(frozen=True)
class Disk:
    root: Path  # the node's data dir
    limit: int | None  # bytes it may hold; None: only the disk's free space limits it

    def used(self) -> int:
        return sum(held_bytes(p) for p in self.root.rglob("*") if p.is_file())

    def cached_bases(self) -> list[Path]:
        """Cached base models, partial downloads and float32 checkpoints (directories), least
        recently used first."""
        found = [p for p in (self.root / "models").glob("*.gguf*") if p.is_file()]
        found += [p for p in (self.root / "hf").glob("*") if p.is_dir()]
        return sorted(found, key=used_at)

    def make_room(self, size: int, what: str, replacing: Path | None = None, keep: Iterable[Path] = ()) -> None:
        """Room for `size` more bytes (`what`, for the message), less what `replacing` holds (a
        partial file it completes); cached bases not in `keep` are removed to make it. Raises
        `DiskFull`, having removed nothing, when even that would not do."""
        self.root.mkdir(parents=True, exist_ok=True)
        keep = {p.resolve() for p in (*keep, *([replacing] if replacing else []))}
        need = max(size - (held_bytes(replacing) if replacing else 0), 0)
        spare = [p for p in self.cached_bases() if p.resolve() not in keep]
        if self._shortfall(need) > sum(held_bytes(p) for p in spare):
            limit = f"--max-disk {self.limit / 2**30:.1f} GiB, " if self.limit is not None else ""
            free = max(shutil.disk_usage(self.root).free - MARGIN, 0)
            raise DiskFull(f"{what} needs {size / 2**30:.2f} GiB; {self.root} holds {self.used() / 2**30:.2f} GiB "
                           f"({limit}{free / 2**30:.1f} GiB free on its disk, keeping {MARGIN >> 30} GiB "
                           "spare): free some space, raise --max-disk or point --data-dir elsewhere")
        for path in spare:
            if self._shortfall(need) <= 0:
                return
            remove(path)

    def _shortfall(self, need: int) -> int:
        """Bytes missing for `need` more: past the disk's free space or past the limit."""
        past_free = need - (shutil.disk_usage(self.root).free - MARGIN)
        past_limit = self.used() + need - self.limit if self.limit is not None else 0
        return max(past_free, past_limit, 0)
