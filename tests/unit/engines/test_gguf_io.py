"""engines.gguf_io reading: one header field, as gguf's own reader reads it; a model's tensors,
dequantized under their HF names, as transformers loads them."""

import struct

import gguf
import numpy as np
import pytest

from engines.gguf_io import permute_qk, quantize, read_model, unpermute_qk
from engines.gguf_read import read_field, read_tensors, tensor_shapes
from engines.hf import load_master


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
    with pytest.raises(ValueError, match="cut short|more than it can hold"):  # (its vocabulary does not fit)
        read_field(cut, "no.such.key")
    (tmp_path / "x.gguf").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_field(tmp_path / "x.gguf", "general.architecture")


def test_read_model_is_what_transformers_loads(tiny_model, tmp_path):
    # fp32: exactly the weights written, q/k rows permuted back to HF's layout.
    config, master = load_master(tiny_model)
    assert all(np.array_equal(a, master[k]) for k, a in read_model(tiny_model, config, master).items())
    # Quantized: each tensor as gguf's reader dequantizes it, and the model as transformers does.
    q4 = quantize(tiny_model, tmp_path / "q4.gguf", "q4_k_m")
    expected = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(q4)).tensors}
    got = read_tensors(q4)
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    _, dequantized = load_master(q4)
    back = read_model(q4, config, dequantized)
    assert all(np.array_equal(back[k], dequantized[k]) for k in dequantized)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(q4.read_bytes()[:-100])
    with pytest.raises(ValueError, match="cut short"):
        read_tensors(cut)


def test_unpermute_undoes_permute():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    assert not np.array_equal(permute_qk(w, 3), w)
    assert np.array_equal(unpermute_qk(permute_qk(w, 3), 3), w)


def header(n_tensors: int, fields: bytes, n_fields: int, tail: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_fields) + fields + tail


def key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize("data, what", [
    (header(0, b"", 1 << 40), "1099511627776 metadata fields"),
    (header(1 << 40, b"", 0), "1099511627776 tensors"),
    # an array of 2^40 strings, or of 2^30 empty arrays, in a file of a few kilobytes
    (header(0, key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 40), 1, bytes(4096)),
     "1099511627776 array items"),
    (header(0, key("nested") + struct.pack("<IIQ", 9, 9, 1 << 30), 1, bytes(4096)), "1073741824 array items"),
    (header(0, key("floats") + struct.pack("<IIQ", 9, 6, 1 << 40), 1, bytes(4096)), "1099511627776 array items"),
    (header(1, b"", 0, key("blk.0.w") + struct.pack("<I", 1 << 31) + bytes(4096)), "2147483648 dimensions"),
])
def test_counts_a_header_states_are_bounded_before_they_are_looped_over(tmp_path, data, what):
    """A coordinator's GGUF whose header states more fields, tensors, items or dimensions than it
    could hold is refused before the node loops over them (the loop was bounded only by the file's
    size: minutes of a node's CPU for a file of gigabytes; issue 55 point 11)."""
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"states {what}, more than it can hold"):
        tensor_shapes(path)
