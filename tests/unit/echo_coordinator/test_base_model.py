"""`--model` resolved and checked before anything slow starts, with errors that say what to give
instead; the cache key of a checkpoint; the signed chunk list nodes fetch the base by."""

from __future__ import annotations

import json

import pytest

from echo_coordinator import base_model
from echo_coordinator.base_model import ModelError
from protocols.signing import generate_key, public_bytes, sha256_hex, verify_message


def checkpoint(directory, model_type="qwen2", architectures=("Qwen2ForCausalLM",), weights=True):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": list(architectures)}))
    if weights:
        (directory / "model.safetensors").write_bytes(b"weights")
    return directory


def test_resolve_takes_a_gguf_file_or_a_checkpoint_directory_and_explains_anything_else(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert base_model.resolve(str(gguf_file)) == gguf_file.resolve()
    assert base_model.resolve(str(checkpoint(tmp_path / "ckpt"))) == (tmp_path / "ckpt").resolve()
    (tmp_path / "m.bin").write_bytes(b"")
    with pytest.raises(ModelError, match="not a .gguf"):
        base_model.resolve(str(tmp_path / "m.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="without config.json"):
        base_model.resolve(str(tmp_path / "empty"))
    with pytest.raises(ModelError, match="does not exist"):
        base_model.resolve(str(tmp_path / "missing.gguf"))


def test_an_unsupported_or_weightless_checkpoint_is_refused_with_the_supported_list(tmp_path):
    assert base_model.checkpoint_arch(checkpoint(tmp_path / "ok")) == "qwen2"
    with pytest.raises(ModelError, match="'MixtralForCausalLM' is not supported; supported: .*Qwen2ForCausalLM"):
        base_model.checkpoint_arch(checkpoint(tmp_path / "moe", "mixtral", ("MixtralForCausalLM",)))
    with pytest.raises(ModelError, match="is not supported"):  # a model_type of ours under another class
        base_model.checkpoint_arch(checkpoint(tmp_path / "odd", "qwen2", ("Qwen2ForSequenceClassification",)))
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        base_model.checkpoint_arch(checkpoint(tmp_path / "bare", weights=False))


def test_the_cache_key_changes_with_the_files_that_define_the_model_only(tmp_path):
    directory = checkpoint(tmp_path / "ckpt")
    before = base_model.source_hash(directory)
    (directory / "README.md").write_text("notes")  # not part of the model
    assert base_model.source_hash(directory) == before
    (directory / "model.safetensors").write_bytes(b"other weights")
    assert base_model.source_hash(directory) != before


def test_the_model_file_lists_every_chunk_by_hash_and_is_signed(tmp_path):
    path = tmp_path / "base.gguf"
    data = bytes(range(256)) * 10  # 2560 bytes: three chunks of 1000, the last short
    path.write_bytes(data)
    key = generate_key()
    listed = base_model.model_file(path, "run-1", key, chunk_size=1000)
    verify_message(listed, public_bytes(key))
    assert listed.size == 2560 and listed.sha256 == sha256_hex(data) and listed.name == "base.gguf"
    assert listed.chunks == tuple(sha256_hex(data[i:i + 1000]) for i in range(0, 2560, 1000))
