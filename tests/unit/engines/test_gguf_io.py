"""engines.gguf_io.read_field: one header field, as gguf's own reader reads it."""

import gguf
import pytest

from engines.gguf_io import read_field


def test_read_field_agrees_with_the_gguf_reader(tiny_model, tmp_path):
    fields = gguf.GGUFReader(str(tiny_model)).fields
    # Strings, integers and floats, before and after the vocabulary arrays it must step over.
    for key in ("general.architecture", "llama.block_count", "llama.attention.layer_norm_rms_epsilon",
                "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert read_field(tiny_model, key) == pytest.approx(fields[key].contents()), key
    assert read_field(tiny_model, "no.such.key") is None
    with pytest.raises(ValueError, match="not a scalar"):
        read_field(tiny_model, "tokenizer.ggml.tokens")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_model.read_bytes()[:4096])
    with pytest.raises(ValueError, match="cut short"):
        read_field(cut, "no.such.key")
    (tmp_path / "x.gguf").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_field(tmp_path / "x.gguf", "general.architecture")
