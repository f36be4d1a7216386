"""protocols.delta: round trips, top-k selection, rejection of bad payloads, and the
error-feedback invariant (a receiver that only calls `apply` stays bit-identical to the
encoder's view)."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocols.delta import (
    MAX_ELEMENTS,
    DeltaEncoder,
    Encoding,
    apply,
    bf16_bits_to_float32,
    decode,
    encode,
    float32_to_bf16_bits,
    max_payload_bytes,
    topk_count,
    topk_join,
)
from protocols.delta import topk_payload as encode_chosen
from protocols.errors import CodecError, ProtocolError

PROPERTY = settings(max_examples=200, deadline=None)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)
DENSE = [Encoding.DENSE_FP32, Encoding.DENSE_FP16, Encoding.DENSE_BF16]
TOPK = Encoding.TOPK_INT8
DENSITIES = st.floats(1e-3, 1.0)


def f32_arrays(max_abs: float | None = None, shapes=SHAPES):
    bound = None if max_abs is None else float(np.float32(max_abs))
    elements = st.floats(
        None if bound is None else -bound, bound, allow_nan=False, allow_infinity=False, width=32
    )
    return hnp.arrays(np.float32, shapes, elements=elements)


def bits(a: np.ndarray) -> np.ndarray:
    assert a.dtype == np.float32
    return np.ascontiguousarray(a).view(np.uint32)


def parse_topk(payload: bytes) -> tuple[int, float, np.ndarray, np.ndarray]:
    """Written from the documented layout, independently of the module's own dtypes."""
    k, scale = struct.unpack_from("<If", payload)
    idx = np.frombuffer(payload, dtype="<u4", count=k, offset=8)
    q = np.frombuffer(payload, dtype="i1", count=k, offset=8 + 4 * k)
    return k, scale, idx, q


def topk_payload(k: int, scale: float, idx, q) -> bytes:
    indices, values = np.asarray(idx, "<u4").tobytes(), np.asarray(q, "i1").tobytes()
    return struct.pack("<If", k, scale) + indices + values


def expected_k(density: float, n: int) -> int:
    return min(n, max(1, math.ceil(density * n)))


# --- round trips -------------------------------------------------------------------------------


@PROPERTY
@given(x=f32_arrays())
def test_dense_fp32_round_trip_is_bit_exact(x):
    payload = encode(x, Encoding.DENSE_FP32)
    assert len(payload) == 4 * x.size
    y = decode(payload, Encoding.DENSE_FP32, x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.array_equal(bits(y), bits(x))


@PROPERTY
@given(x=f32_arrays(65000.0))
def test_dense_fp16_round_trip_is_within_half_precision(x):
    payload = encode(x, Encoding.DENSE_FP16)
    assert len(payload) == 2 * x.size
    y = decode(payload, Encoding.DENSE_FP16, x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.array_equal(y, x.astype(np.float16).astype(np.float32))
    x64 = x.astype(np.float64)
    # 10 mantissa bits: half an ulp is 2**-11 relative; fp16 subnormals are spaced 2**-24.
    assert np.all(np.abs(y - x64) <= np.maximum(np.abs(x64) * 2.0**-11, 2.0**-25))


@PROPERTY
@given(x=f32_arrays(1e38))
def test_dense_bf16_round_trip_is_within_bfloat16_precision(x):
    payload = encode(x, Encoding.DENSE_BF16)
    assert len(payload) == 2 * x.size
    y = decode(payload, Encoding.DENSE_BF16, x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    x64 = x.astype(np.float64)
    # 7 mantissa bits: half an ulp is 2**-8 relative; bf16 subnormals are spaced 2**-133.
    assert np.all(np.abs(y - x64) <= np.maximum(np.abs(x64) * 2.0**-8, 2.0**-134))
    assert np.array_equal(np.frombuffer(payload, "<u2"), float32_to_bf16_bits(x).ravel())


def _f32_from_bits(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def reference_bf16(u: int) -> int:
    """Nearest bf16 by exact rational distance, ties to the even pattern: no bit tricks."""
    x = _f32_from_bits(u)
    if math.isinf(x):
        return u >> 16
    lo, hi = u >> 16, (u >> 16) + 1  # truncation toward zero, and the next magnitude up

    def value(b: int) -> Fraction:
        if b & 0x7FFF == 0x7F80:  # inf: for rounding, the step after the largest finite bf16
            return Fraction(-(2**128) if b & 0x8000 else 2**128)
        return Fraction(_f32_from_bits(b << 16))

    d_lo, d_hi = abs(Fraction(x) - value(lo)), abs(value(hi) - Fraction(x))
    if d_lo != d_hi:
        return lo if d_lo < d_hi else hi
    return lo if lo % 2 == 0 else hi


# Upper halves uniformly, lower halves biased toward the tie and near-tie patterns.
FLOAT32_BITS = st.tuples(
    st.integers(0, 0xFFFF),
    st.sampled_from([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]) | st.integers(0, 0xFFFF),
).map(lambda t: t[0] << 16 | t[1])


@PROPERTY
@given(patterns=st.lists(FLOAT32_BITS, max_size=16))
@example(patterns=[0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF])
@example(patterns=[0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x00008000])
def test_bf16_rounding_matches_an_exact_reference(patterns):
    u = np.array(patterns, dtype=np.uint32)
    got = float32_to_bf16_bits(u.view(np.float32))
    assert got.dtype == np.uint16 and got.shape == u.shape
    for pattern, b in zip(patterns, got.tolist()):
        if math.isnan(_f32_from_bits(pattern)):
            assert b & 0x7F80 == 0x7F80 and b & 0x007F, f"{pattern:#010x} -> {b:#06x} is not NaN"
            assert b & 0x8000 == pattern >> 16 & 0x8000, "NaN lost its sign"
        else:
            assert b == reference_bf16(pattern), f"{pattern:#010x} -> {b:#06x}"
    back = bf16_bits_to_float32(got)
    assert back.dtype == np.float32
    assert np.array_equal(back.view(np.uint32), got.astype(np.uint32) << 16)


@PROPERTY
@given(x=f32_arrays(1e30), density=DENSITIES)
def test_topk_keeps_the_largest_magnitudes_within_half_a_step(x, density):
    payload = encode(x, TOPK, density=density)
    k, scale, idx, q = parse_topk(payload)
    assert k == expected_k(density, x.size)
    assert len(payload) == 8 + 5 * k
    assert np.all(np.diff(idx.astype(np.int64)) > 0)
    assert np.all(np.abs(q.astype(int)) <= 127)

    flat = x.ravel().astype(np.float64)
    magnitude = np.abs(flat)
    dropped = np.ones(x.size, dtype=bool)
    dropped[idx] = False
    if k and dropped.any():
        assert magnitude[idx].min() >= magnitude[dropped].max()
    peak = magnitude[idx].max() if k else 0.0
    assert scale == np.float32(peak / 127)

    y = decode(payload, TOPK, x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    y = y.ravel().astype(np.float64)
    assert np.all(y[dropped] == 0)
    # Half a quantisation step, plus the final float32 rounding of q * scale, plus what clipping
    # at 127 loses where float32 rounded the scale down: within that rounding for normal numbers,
    # but for subnormal deltas (hypothesis found 1.8e-44 and 1.1e-42) a scale of few bits, or 0.
    clipped = 127 * max(0.0, peak / 127 - float(scale))
    tolerance = scale / 2 + float(np.spacing(np.float32(peak))) + clipped
    assert np.all(np.abs(y[idx] - flat[idx]) <= tolerance)
    if peak / 127 >= float(np.finfo(np.float32).tiny):  # a normal scale: the clip term is rounding-sized
        assert clipped <= float(np.spacing(np.float32(peak)))


def test_topk_of_an_all_zero_delta_has_zero_scale():
    payload = encode(np.zeros((3, 3), np.float32), TOPK, density=0.5)
    k, scale, _, q = parse_topk(payload)
    assert (k, scale) == (5, 0.0) and not q.any()
    assert not decode(payload, TOPK, (3, 3)).any()


def test_decode_returns_a_fresh_writable_array():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for enc in Encoding:
        y = decode(encode(x, enc, density=1.0), enc, (2, 3))
        assert y.flags.writeable and y.flags.c_contiguous
    # A dense-fp32 bytearray is taken over, not copied: a full-mode snapshot is not held twice.
    payload = bytearray(encode(x, Encoding.DENSE_FP32))
    y = decode(payload, Encoding.DENSE_FP32, (2, 3))
    assert np.shares_memory(y, np.frombuffer(payload, np.uint8)) and np.array_equal(y, x) and y.flags.writeable


def parse_int4(payload: bytes, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales, q) written from the documented layout, independently of the module."""
    blocks = -(-n // 128)
    scales = np.frombuffer(payload, dtype="<f4", count=blocks)
    q = []
    for byte in payload[4 * blocks :]:
        q += [(byte & 0xF) - 16 * ((byte >> 3) & 1), (byte >> 4) - 16 * (byte >> 7)]
    return scales, np.array(q[:n], dtype=np.int64)


@PROPERTY
@given(x=f32_arrays(max_abs=1e30, shapes=hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=300)))
def test_dense_int4_keeps_every_element_within_half_a_step_of_its_block(x):
    payload = encode(x, Encoding.DENSE_INT4)
    flat = x.ravel().astype(np.float64)
    scales, q = parse_int4(payload, flat.size)
    assert len(payload) == 4 * len(scales) + -(-flat.size // 2) and np.abs(q).max(initial=0) <= 7
    step = np.repeat(scales.astype(np.float64), 128)[: flat.size]
    got = decode(payload, Encoding.DENSE_INT4, x.shape).ravel().astype(np.float64)
    assert np.array_equal(got, (q * step).astype(np.float32).astype(np.float64))  # the documented value
    assert np.all(np.abs(got - flat) <= step / 2 * (1 + 1e-6) + 1e-38)


@pytest.mark.parametrize("extra", [-1, 1])
def test_dense_int4_payload_of_wrong_length(extra):
    good = encode(np.ones(300, np.float32), Encoding.DENSE_INT4)
    bad = good[:extra] if extra < 0 else good + b"\0"
    with pytest.raises(CodecError, match="dense-int4 of 300 elements needs"):
        decode(bad, Encoding.DENSE_INT4, (300,))


@pytest.mark.parametrize("scale", [math.nan, math.inf, -0.5])
def test_dense_int4_bad_scale(scale):
    payload = bytearray(encode(np.ones(300, np.float32), Encoding.DENSE_INT4))
    payload[4:8] = struct.pack("<f", scale)  # the second block's scale
    with pytest.raises(CodecError, match="dense-int4 scale 1 is"):
        decode(bytes(payload), Encoding.DENSE_INT4, (300,))


# --- error feedback ----------------------------------------------------------------------------


def random_weights(rng: np.random.Generator, shape, previous: np.ndarray | None) -> np.ndarray:
    """Mixes plain noise, small steps from the previous target, and integer ties for top-k."""
    kind = rng.integers(3)
    if kind == 1 and previous is not None:
        values = previous + rng.normal(size=shape) * 1e-3
    elif kind == 2:
        values = rng.integers(-3, 4, size=shape)
    else:
        values = rng.normal(size=shape) * 10.0 ** rng.uniform(-3, 1)
    return np.asarray(values, dtype=np.float32)  # asarray: 0-d draws come back as scalars


@PROPERTY
@given(
    shapes=st.dictionaries(st.text(min_size=1, max_size=6), SHAPES, min_size=1, max_size=3),
    encoding=st.sampled_from(list(Encoding)),
    density=DENSITIES,
    n_updates=st.integers(1, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_receiver_applying_payloads_stays_bit_identical_to_the_encoder_view(
    shapes, encoding, density, n_updates, seed
):
    rng = np.random.default_rng(seed)
    base = {name: random_weights(rng, shape, None) for name, shape in shapes.items()}
    encoder = DeltaEncoder(base)
    receiver = {name: w.copy() for name, w in base.items()}
    target = base
    for _ in range(n_updates):
        target = {name: random_weights(rng, shapes[name], target[name]) for name in shapes}
        payloads = encoder.encode_update(target, encoding, density)
        assert set(payloads) == set(shapes)
        for name, payload in payloads.items():
            wire = bytes(bytearray(payload))  # what arrives: a copy, not the encoder's object
            receiver[name] = apply(receiver[name], wire, encoding, name=name)
            view = encoder.view(name)
            assert receiver[name].shape == view.shape == shapes[name]
            assert np.array_equal(bits(receiver[name]), bits(view))


@PROPERTY
@given(
    shape=hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=24),
    encoding=st.sampled_from(list(Encoding)),
    density=st.floats(0.02, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_error_feedback_drives_the_residual_toward_a_fixed_target(shape, encoding, density, seed):
    rng = np.random.default_rng(seed)
    bound_abs = 10.0
    base = rng.uniform(-bound_abs, bound_abs, size=shape).astype(np.float32)
    target = rng.uniform(-bound_abs, bound_abs, size=shape).astype(np.float32)
    encoder = DeltaEncoder({"w": base})
    n = base.size
    # A round gives every entry once the chance to be among the k largest residuals.
    steps_per_round = math.ceil(n / expected_k(density, n)) if encoding is TOPK else 1
    # Each step shrinks a kept entry to at most half a quantisation step (peak / 254 for int8,
    # peak / 14 for int4, the coarsest), plus float32 rounding in `target - view` and `view + delta`.
    shrink = 14 if encoding is Encoding.DENSE_INT4 else 254
    rounding = 8 * float(np.spacing(np.float32(4 * bound_abs)))
    bound = float(np.abs(encoder.residual("w", target)).max())
    for _ in range(2):
        for _ in range(steps_per_round):
            encoder.encode_update({"w": target}, encoding, density)
        bound = bound / shrink + rounding
        assert float(np.abs(encoder.residual("w", target)).max()) <= bound


def test_topk_residual_is_carried_not_dropped():
    target = np.array([4.0, 3.0, 2.0, 1.0], np.float32)
    encoder = DeltaEncoder({"w": np.zeros(4, np.float32)})
    encoder.encode_update({"w": target}, TOPK, density=0.25)
    assert np.array_equal(encoder.view("w"), [4.0, 0.0, 0.0, 0.0])
    assert np.array_equal(encoder.residual("w", target), [0.0, 3.0, 2.0, 1.0])
    for _ in range(3):
        encoder.encode_update({"w": target}, TOPK, density=0.25)
    assert np.array_equal(encoder.view("w"), target)


def test_encoder_view_is_a_read_only_copy_of_the_base():
    base = np.ones(3, np.float32)
    encoder = DeltaEncoder({"w": base})
    base[0] = 7.0
    assert encoder.names == ("w",)
    assert np.array_equal(encoder.view("w"), [1.0, 1.0, 1.0])
    with pytest.raises(ValueError):
        encoder.view("w")[0] = 2.0


# --- bad inputs: every refusal is a CodecError that says what was wrong ------------------------


def test_codec_error_is_a_protocol_error():
    assert issubclass(CodecError, ProtocolError) and CodecError.code == "bad_delta"


def test_dense_length_message_names_tensor_encoding_shape_and_sizes():
    with pytest.raises(CodecError) as info:
        decode(b"\0" * 12, "dense-fp16", (2, 4), name="x")
    expected = "tensor 'x': payload has 12 bytes, dense-fp16 of shape (2, 4) needs 16"
    assert str(info.value) == expected


@pytest.mark.parametrize("encoding", DENSE)
@pytest.mark.parametrize("extra", [-1, 1, -2])
def test_dense_payload_of_wrong_length(encoding, extra):
    payload = encode(np.ones((2, 4), np.float32), encoding)
    bad = payload[:extra] if extra < 0 else payload + b"\0" * extra
    with pytest.raises(CodecError, match=rf"has {len(bad)} bytes, {encoding.value} .* needs"):
        decode(bad, encoding, (2, 4))


@pytest.mark.parametrize(
    ("encoding", "value"),
    [
        (Encoding.DENSE_FP32, struct.pack("<f", math.nan)),
        (Encoding.DENSE_FP32, struct.pack("<f", -math.inf)),
        (Encoding.DENSE_FP16, np.array([math.nan], "<f2").tobytes()),
        (Encoding.DENSE_FP16, np.array([math.inf], "<f2").tobytes()),
        (Encoding.DENSE_BF16, struct.pack("<H", 0x7FC0)),  # NaN
        (Encoding.DENSE_BF16, struct.pack("<H", 0xFF80)),  # -inf
    ],
)
def test_nonfinite_dense_value(encoding, value):
    payload = bytearray(encode(np.ones(3, np.float32), encoding))
    payload[len(value) : 2 * len(value)] = value
    with pytest.raises(CodecError, match=r"non-finite values \(first at flat index 1\)"):
        decode(bytes(payload), encoding, (3,))


@pytest.mark.parametrize("length", range(8))
def test_topk_truncated_header(length):
    with pytest.raises(CodecError, match="shorter than the 8-byte topk-int8 header"):
        decode(b"\1" * length, TOPK, (4,))


@pytest.mark.parametrize("extra", [-1, 1])
def test_topk_payload_of_wrong_length_for_its_k(extra):
    payload = topk_payload(2, 0.5, [0, 3], [1, -1])
    bad = payload[:extra] if extra < 0 else payload + b"\0"
    with pytest.raises(CodecError, match=rf"has {len(bad)} bytes, topk-int8 with k=2 needs 18"):
        decode(bad, TOPK, (4,))


def test_topk_k_larger_than_the_tensor():
    with pytest.raises(CodecError, match="k=5 exceeds the tensor's 4 elements"):
        decode(topk_payload(5, 0.5, range(5), [1] * 5), TOPK, (4,))


def test_topk_index_out_of_range():
    with pytest.raises(CodecError, match="index 4 is out of range for 4 elements"):
        decode(topk_payload(2, 0.5, [1, 4], [1, 1]), TOPK, (2, 2))


def test_topk_duplicate_indices():
    with pytest.raises(CodecError, match=r"strictly increasing; index\[2\]=2 follows 2"):
        decode(topk_payload(3, 0.5, [0, 2, 2], [1, 1, 1]), TOPK, (4,))


def test_topk_unsorted_indices():
    with pytest.raises(CodecError, match=r"strictly increasing; index\[1\]=1 follows 3"):
        decode(topk_payload(2, 0.5, [3, 1], [1, 1]), TOPK, (4,))


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, -0.5])
def test_topk_bad_scale(scale):
    with pytest.raises(CodecError, match="scale is .*, must be finite and >= 0"):
        decode(topk_payload(1, scale, [0], [1]), TOPK, (4,))


def test_topk_scale_that_overflows_the_decoded_value():
    with pytest.raises(CodecError, match="non-finite"):
        decode(topk_payload(1, 3e38, [0], [127]), TOPK, (4,))


@pytest.mark.parametrize(
    "shape", [(-1,), (2.0,), (True, 2), ("4",), "4", 4, (2**31, 2), (2**32,), (1,) * 33]
)
def test_invalid_shape(shape):
    with pytest.raises(CodecError, match="shape"):
        decode(b"", Encoding.DENSE_FP32, shape)


def test_payload_that_is_not_bytes():
    with pytest.raises(CodecError, match="payload must be bytes, got str"):
        decode("\0\0\0\0", Encoding.DENSE_FP32, (1,))
    assert decode(memoryview(b"\0\0\x80\x3f"), Encoding.DENSE_FP32, (1,)) == 1.0


@pytest.mark.parametrize("encoding", list(Encoding))
def test_apply_to_weights_of_the_wrong_shape(encoding):
    payload = encode(np.ones((2, 4), np.float32), encoding, density=1.0)
    with pytest.raises(CodecError, match="tensor 'w'"):
        apply(np.zeros(3, np.float32), payload, encoding, name="w")


@pytest.mark.parametrize("weights", [np.zeros(4, np.float64), np.zeros(4, np.float16), [0.0] * 4])
def test_apply_to_weights_that_are_not_float32(weights):
    payload = encode(np.ones(4, np.float32), Encoding.DENSE_FP32)
    with pytest.raises(CodecError, match="weights must be a float32 ndarray"):
        apply(weights, payload, Encoding.DENSE_FP32)


@pytest.mark.parametrize("encoding", ["dense-fp8", "DENSE-FP32", "", None, 3])
def test_unknown_encoding(encoding):
    x = np.ones(4, np.float32)
    match = "unknown encoding"
    with pytest.raises(CodecError, match=match):
        encode(x, encoding)
    with pytest.raises(CodecError, match=match):
        decode(b"\0" * 16, encoding, (4,))
    with pytest.raises(CodecError, match=match):
        apply(x, b"\0" * 16, encoding)
    encoder = DeltaEncoder({"w": x})
    with pytest.raises(CodecError, match=match):
        encoder.encode_update({"w": x}, encoding)
    assert np.array_equal(encoder.view("w"), x)


@pytest.mark.parametrize("delta", [np.ones(3, np.float64), np.ones(3, np.int32), [1.0, 2.0]])
def test_encode_of_a_delta_that_is_not_float32(delta):
    with pytest.raises(CodecError, match="delta must be a float32 ndarray"):
        encode(delta, Encoding.DENSE_FP32)


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_encode_of_a_nonfinite_delta(encoding, bad):
    with pytest.raises(CodecError, match="delta has 1 non-finite values"):
        encode(np.array([0.0, bad], np.float32), encoding)


@pytest.mark.parametrize(
    ("encoding", "value"), [(Encoding.DENSE_FP16, 7e4), (Encoding.DENSE_BF16, 3.4e38)]
)
def test_encode_of_a_delta_the_encoding_cannot_represent(encoding, value):
    with pytest.raises(CodecError, match=f"tensor 'w': delta value .* overflows {encoding.value}"):
        encode(np.array([1.0, value], np.float32), encoding, name="w")


def test_topk_encode_of_a_delta_whose_scale_would_overflow():
    biggest = np.finfo(np.float32).max
    with pytest.raises(CodecError, match="overflows topk-int8"):
        encode(np.array([1.0, biggest], np.float32), TOPK, density=1.0)


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, math.nan])
def test_topk_density_out_of_range(density):
    with pytest.raises(ValueError, match="density"):
        encode(np.ones(4, np.float32), TOPK, density=density)


def test_encoder_unknown_tensor_name():
    encoder = DeltaEncoder({"w": np.zeros(2, np.float32)})
    with pytest.raises(CodecError, match="unknown tensor 'v'"):
        encoder.view("v")
    with pytest.raises(CodecError, match="unknown tensor 'v'"):
        encoder.residual("v", np.zeros(2, np.float32))
    with pytest.raises(CodecError, match=r"unknown tensors \['v'\], missing \[\]"):
        encoder.encode_update({"w": np.ones(2, np.float32), "v": np.ones(2, np.float32)}, TOPK)


def test_encoder_missing_tensor():
    encoder = DeltaEncoder({"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)})
    with pytest.raises(CodecError, match=r"unknown tensors \[\], missing \['b'\]"):
        encoder.encode_update({"w": np.ones(2, np.float32)}, TOPK)


def test_encoder_target_of_the_wrong_shape():
    encoder = DeltaEncoder({"w": np.zeros((2, 3), np.float32)})
    with pytest.raises(CodecError, match=r"target has shape \(3, 2\), the view has \(2, 3\)"):
        encoder.encode_update({"w": np.ones((3, 2), np.float32)}, Encoding.DENSE_FP32)


def test_encoder_target_that_is_not_float32():
    encoder = DeltaEncoder({"w": np.zeros(2, np.float32)})
    with pytest.raises(CodecError, match="target must be a float32 ndarray, got float64"):
        encoder.encode_update({"w": np.ones(2, np.float64)}, Encoding.DENSE_FP32)


def test_encoder_base_that_is_not_float32():
    with pytest.raises(CodecError, match="base weights must be a float32 ndarray, got float64"):
        DeltaEncoder({"w": np.zeros(2, np.float64)})


def test_failed_update_leaves_every_view_untouched():
    encoder = DeltaEncoder({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)})
    target = {"a": np.ones(2, np.float32), "b": np.array([1.0, 1e5], np.float32)}
    with pytest.raises(CodecError, match="tensor 'b': delta value 100000.0 overflows dense-fp16"):
        encoder.encode_update(target, Encoding.DENSE_FP16)
    assert not encoder.view("a").any() and not encoder.view("b").any()


def test_shape_limit_matches_the_index_width():
    assert MAX_ELEMENTS <= 2**32  # flat indices travel as '<u4'


def test_parts_encoded_with_one_scale_join_into_the_whole_payload():
    """A sharded trainer's ranks each encode their slice's entries with the tensor's one peak, and
    the joined parts are the payload of the whole (empty parts included)."""
    rng = np.random.default_rng(3)
    flat = rng.standard_normal(1000).astype(np.float32)
    whole = encode(flat, "topk-int8", density=0.05)
    k = topk_count(flat.size, 0.05)
    chosen = np.sort(np.argsort(-np.abs(flat))[:k])
    peak = float(np.abs(flat[chosen]).max())
    bounds = [0, 400, 400, 999, 1000]  # one empty slice, one of a single element
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        mine = chosen[(chosen >= lo) & (chosen < hi)]
        parts.append((lo, encode_chosen(mine - lo, flat[mine], peak=peak)))
    assert topk_join(parts) == whole


@PROPERTY
@given(x=f32_arrays(1e3), density=DENSITIES, encoding=st.sampled_from(list(Encoding)))
def test_a_payload_never_exceeds_its_encodings_bound(x, density, encoding):
    """`max_payload_bytes` is what a node lets a manifest declare before fetching: every payload
    a trainer can send fits in it, and the densest topk-int8 one fills it exactly."""
    assert len(encode(x, encoding, density=density)) <= max_payload_bytes(x.shape, encoding)
    if encoding is not Encoding.TOPK_INT8:
        assert len(encode(x, encoding)) == max_payload_bytes(x.shape, encoding)
    assert len(encode(x, Encoding.TOPK_INT8, density=1.0)) == max_payload_bytes(x.shape, Encoding.TOPK_INT8)


def test_the_payload_bound_refuses_shapes_and_encodings_it_cannot_size():
    with pytest.raises(CodecError, match="over 2"):
        max_payload_bytes((2**20, 2**12), "dense-fp32")
    with pytest.raises(CodecError, match="unknown encoding"):
        max_payload_bytes((4,), "zstd")
