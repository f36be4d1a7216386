"""The node's disk limit: cached bases of other runs make room, least recently used first, and a
write that cannot fit is refused before a byte of it is written, with nothing removed."""

import os

import pytest

from echo_node import disk
from echo_node.disk import Disk, DiskFull, touch

MIB = 1 << 20


def cached(root, name, size, used_at):
    path = root / "models" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))  # random: no filesystem holds it in fewer blocks
    os.utime(path, (used_at, path.stat().st_mtime))
    return path


def test_old_bases_make_room_least_recently_used_first(tmp_path):
    old = cached(tmp_path, "a.gguf", 3 * MIB, used_at=1000)
    newer = cached(tmp_path, "b.gguf", 3 * MIB, used_at=2000)
    partial = cached(tmp_path, "c.gguf.partial", 1 * MIB, used_at=1500)
    node = Disk(tmp_path, 8 * MIB)
    node.make_room(3 * MIB, "the base model")  # 7 MiB held: the oldest (a) alone makes room
    assert not old.exists() and partial.exists() and newer.exists()
    node.make_room(6 * MIB, "the base model")  # then c, then b
    assert not partial.exists() and not newer.exists()


def test_a_write_past_the_limit_is_refused_and_nothing_is_removed(tmp_path):
    base = cached(tmp_path, "a.gguf", 3 * MIB, used_at=1000)
    other = cached(tmp_path, "b.gguf", 2 * MIB, used_at=1000)
    node = Disk(tmp_path, 8 * MIB)
    with pytest.raises(DiskFull, match=r"the adapter needs 0\.01 GiB.*--max-disk 0\.0 GiB"):
        node.make_room(7 * MIB, "the adapter", keep=[base])  # b's 2 MiB cannot make 7 fit beside a's 3
    assert base.exists() and other.exists()
    node.make_room(5 * MIB, "the adapter", keep=[base])  # but b's can make 5 fit
    assert base.exists() and not other.exists()


def test_a_partial_download_counts_its_own_bytes_as_room(tmp_path):
    partial = cached(tmp_path, "a.gguf.partial", 3 * MIB, used_at=1000)
    Disk(tmp_path, 4 * MIB).make_room(4 * MIB, "the base model", replacing=partial)
    assert partial.exists()


def test_the_free_space_of_the_disk_limits_too(tmp_path, monkeypatch):
    base = cached(tmp_path, "a.gguf", 2 * MIB, used_at=1000)
    real = disk.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: real._replace(free=disk.MARGIN + MIB))
    with pytest.raises(DiskFull, match="free on its disk"):
        Disk(tmp_path, None).make_room(4 * MIB, "the base model")
    assert base.exists()


def test_touch_marks_a_base_used_and_keeps_its_modification_time(tmp_path):
    base = cached(tmp_path, "a.gguf", MIB, used_at=1000)
    before = base.stat().st_mtime_ns
    touch(base)
    assert base.stat().st_atime > 1000 and base.stat().st_mtime_ns == before


def test_other_runs_float32_checkpoints_make_room_too(tmp_path):
    """Full mode keeps the base's float32 checkpoint in the data dir (`hf/SHA/`): a directory,
    counted whole and removed whole, least recently used first beside the cached bases."""
    base = cached(tmp_path, "a.gguf", 2 * MIB, used_at=2000)
    checkpoint = tmp_path / "hf" / "0123"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(os.urandom(3 * MIB))
    (checkpoint / "config.json").write_text("{}")
    os.utime(checkpoint / "config.json", (1000, 1000))  # when it was last loaded
    node = Disk(tmp_path, 8 * MIB)
    assert disk.held_bytes(checkpoint) >= 3 * MIB and node.cached_bases() == [checkpoint, base]
    node.make_room(5 * MIB, "version 3's weights")
    assert not checkpoint.exists() and base.exists()


def test_a_full_mode_checkpoint_is_written_in_the_data_dir_under_its_limit(tmp_path, monkeypatch):
    """Issue 36 point 6: the float32 checkpoint went to ~/.cache/echo/hf, outside `--max-disk`
    and never evicted. Now room is made for it (its size read from the GGUF header) before it
    is written, in the data dir; one past the limit is refused first."""
    from echo_node.main import _make_room_for_checkpoint
    from echo_node.session import Session
    from engines import hf
    from protocols.signing import sha256_file
    from tests.support.tiny_model import build_tiny_gguf
    from tests.unit.echo_node.conftest import config
    from tests.unit.protocols import factories

    monkeypatch.setattr(hf, "_cache_root", None)  # use_cache is process-wide: undone after the test
    model = build_tiny_gguf(tmp_path / "base.gguf")
    manifest = factories.manifest(base_sha256=sha256_file(model), update="full")
    expected = hf.checkpoint_bytes(model)
    small = Session(config(tmp_path, max_disk_gib=expected / 2 / 2**30))
    with pytest.raises(DiskFull, match="float32 checkpoint"):
        _make_room_for_checkpoint(small, manifest, model)
    session = Session(config(tmp_path, max_disk_gib=4 * expected / 2**30))
    _make_room_for_checkpoint(session, manifest, model)
    written = hf.gguf_checkpoint(model)
    assert written == session.data_dir / "hf" / manifest.base_sha256[:32]
    assert 0.9 * expected < disk.held_bytes(written / "model.safetensors") < 1.1 * expected
