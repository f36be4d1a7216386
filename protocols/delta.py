"""Lossy weight-delta codec with exact error feedback.

A trainer publishes weight updates to many inference nodes. For every tensor it sends
`target - view`, where `view` is what the receivers hold, compressed by one of four encodings,
and then advances its own copy of `view` with the very same `apply` the receivers run. Hence

    invariant: after every update, `DeltaEncoder.view(name)` is bit-for-bit equal to the
    weights of every receiver that started from the same base and applied every payload, in
    order, with `apply`.

Whatever an encoding dropped or rounded stays in `target - view` and is sent next time (error
feedback), so compression error is carried forward instead of accumulating as drift.

Payload layouts. All little-endian, tensor elements in C order, `n` = number of elements. The
shape and the encoding travel beside the payload in the wire record, never inside it.

    dense-fp32   n x '<f4'
    dense-fp16   n x '<f2'
    dense-bf16   n x '<u2'   upper 16 bits of the float32, rounded to nearest, ties to even
    topk-int8    header ['<u4' k]['<f4' scale], then k x '<u4' flat indices (strictly
                 increasing), then k x 'i1' q; element[index] = float32(q) * scale, others 0
    dense-int4   ceil(n / 128) x '<f4' scales (one per block of 128 elements), then ceil(n / 2)
                 bytes of 4-bit two's-complement q, element 2i in the low nibble of byte i and
                 2i + 1 in the high one (a pad nibble of 0 when n is odd); element =
                 float32(q) * scale of its block. q in [-7, 7]: every element moves every update,
                 which suits LoRA's small, dense deltas (every adapter weight changes each step)

Master weights and decoded deltas are float32. `decode` and `apply` treat payloads as untrusted
and raise `CodecError` naming exactly what did not fit.

A view may be kept in bf16 (`apply(..., bf16=True)`: every value rounded to bf16 after each
update, on both sides): LoRA runs do, so a bf16 snapshot of the view is exact and late joiners
who start from one hold bit for bit what nodes that applied every delta hold.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

import numpy as np

from protocols.errors import CodecError

MAX_ELEMENTS = 2**31
"""Largest tensor a payload may describe; also keeps every flat index inside a '<u4'."""

_MAX_NDIM = 32  # numpy's array rank limit (older releases; 2.x allows 64)


class Encoding(enum.StrEnum):
    """How a payload stores a delta; the value is what travels in the wire record."""

    DENSE_FP32 = "dense-fp32"
    DENSE_FP16 = "dense-fp16"
    DENSE_BF16 = "dense-bf16"
    TOPK_INT8 = "topk-int8"
    DENSE_INT4 = "dense-int4"


_DENSE_DTYPE = {
    Encoding.DENSE_FP32: np.dtype("<f4"),
    Encoding.DENSE_FP16: np.dtype("<f2"),
    Encoding.DENSE_BF16: np.dtype("<u2"),
}
_TOPK_HEADER = np.dtype([("k", "<u4"), ("scale", "<f4")])
_TOPK_INDEX = np.dtype("<u4")
_TOPK_VALUE = np.dtype("i1")
_QMAX = 127  # symmetric range: -128 is never produced, so q and -q are both representable
INT4_BLOCK = 128  # elements per dense-int4 scale
_Q4MAX = 7

Payload = bytes | bytearray | memoryview


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16, same shape), round to nearest, ties to even."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    rounded = ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    # Rounding would turn a NaN whose payload sits in the low bits into inf (and overflow
    # 0xFFFFFFFF), so NaN keeps its sign and high payload with the quiet bit forced on.
    quiet_nan = ((u >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(u.view(np.float32)), quiet_nan, rounded)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns -> float32 (exact: bf16 is a prefix of float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(
    delta: np.ndarray, encoding: Encoding | str, *, density: float = 0.01, name: str = "?"
) -> bytes:
    """Payload for a float32 `delta`. topk-int8 keeps max(1, ceil(density * n)) entries.

    `name` only labels error messages. Raises CodecError for a non-float32 or non-finite delta,
    or one the encoding cannot represent (fp16/bf16 overflow); ValueError for a bad density.
    """
    enc = _encoding(encoding)
    where = f"tensor {name!r}"
    _check_float32(delta, f"{where}: delta")
    if delta.size > MAX_ELEMENTS:
        raise CodecError(f"{where}: {delta.size} elements exceed the limit of {MAX_ELEMENTS}")
    _check_finite(delta, f"{where}: delta")
    if enc is Encoding.TOPK_INT8:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        return _encode_topk(delta.ravel(), density, where)
    if enc is Encoding.DENSE_INT4:
        return _encode_int4(delta.ravel(), where)
    if enc is Encoding.DENSE_BF16:
        wire = float32_to_bf16_bits(delta)
    else:
        with np.errstate(over="ignore"):  # reported below, with the tensor's name
            wire = delta.astype(_DENSE_DTYPE[enc])
    _check_no_overflow(_dense_to_float32(wire, enc).ravel(), delta.ravel(), enc, where)
    return wire.astype(_DENSE_DTYPE[enc], copy=False).tobytes(order="C")  # '<' on any host


def decode(
    payload: Payload, encoding: Encoding | str, shape: Sequence[int], *, name: str = "?"
) -> np.ndarray:
    """The float32 delta of `shape` carried by an untrusted `payload`: a writable array, which
    for a dense-fp32 bytearray payload is a view of it (the caller hands the buffer over)."""
    enc = _encoding(encoding)
    where = f"tensor {name!r}"
    dims = _check_shape(shape, where)
    n = math.prod(dims)
    if isinstance(payload, memoryview):
        payload = payload.tobytes()
    if not isinstance(payload, (bytes, bytearray)):
        raise CodecError(f"{where}: payload must be bytes, got {type(payload).__name__}")
    if enc is Encoding.TOPK_INT8:
        return _decode_topk(payload, n, where).reshape(dims)
    if enc is Encoding.DENSE_INT4:
        return _decode_int4(payload, n, where).reshape(dims)
    dtype = _DENSE_DTYPE[enc]
    need = n * dtype.itemsize
    if len(payload) != need:
        raise CodecError(
            f"{where}: payload has {len(payload)} bytes, {enc.value} of shape {dims} needs {need}"
        )
    values = _dense_to_float32(np.frombuffer(payload, dtype=dtype, count=n), enc)
    _check_finite(values, f"{where}: {enc.value} payload")
    return values.reshape(dims)


def max_payload_bytes(shape: Sequence[int], encoding: Encoding | str, where: str = "tensor '?'") -> int:
    """The most bytes a payload for `shape` can hold under `encoding`: a receiver knows from a
    manifest, before fetching a byte, what it may be asked to hold (a longer one is refused)."""
    n, enc = math.prod(_check_shape(shape, where)), _encoding(encoding)
    if enc in _DENSE_DTYPE:
        return n * _DENSE_DTYPE[enc].itemsize
    if enc is Encoding.TOPK_INT8:
        return _TOPK_HEADER.itemsize + n * (_TOPK_INDEX.itemsize + _TOPK_VALUE.itemsize)
    return -(-n // INT4_BLOCK) * 4 + -(-n // 2)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), still as float32."""
    return bf16_bits_to_float32(float32_to_bf16_bits(x)).reshape(np.shape(x))


def apply(
    weights: np.ndarray, payload: Payload, encoding: Encoding | str, *, name: str = "?", bf16: bool = False
) -> np.ndarray:
    """New float32 array `weights + decode(payload)`, rounded to bf16 if `bf16`; `weights` is
    left untouched."""
    # The encoder advances its view of the receivers with this function too, on the same float32
    # inputs, so both sides run identical IEEE operations: that, not a tolerance, is what keeps
    # them bit-identical. Never reimplement it on either side.
    _check_float32(weights, f"tensor {name!r}: weights")
    delta = decode(payload, encoding, weights.shape, name=name)
    # `out=` because `+` on 0-d arrays returns a numpy scalar, not an array.
    out = np.add(weights, delta, out=np.empty(weights.shape, dtype=np.float32))
    if bf16:
        out = round_bf16(out)
    _check_finite(out, f"tensor {name!r}: weights after the update")
    return out


class DeltaEncoder:
    """The trainer's half of error feedback: an exact copy of what every receiver holds.

    Not thread-safe: one publisher owns it, and updates must be published in the order made.
    `bf16`: the receivers keep their weights in bf16 (see `apply`); the base must be bf16-valued.
    """

    def __init__(self, base: Mapping[str, np.ndarray], bf16: bool = False) -> None:
        self.bf16 = bf16
        self._view: dict[str, np.ndarray] = {}
        for name, weights in base.items():
            _check_float32(weights, f"tensor {name!r}: base weights")
            if bf16 and not np.array_equal(round_bf16(weights), weights):
                raise CodecError(f"tensor {name!r}: a bf16 view needs bf16-valued base weights")
            self._view[name] = _frozen(weights.copy())

    @property
    def names(self) -> tuple[str, ...]:
        """Every tensor an update must carry, in base order."""
        return tuple(self._view)

    def view(self, name: str) -> np.ndarray:
        """Read-only float32 array: what receivers hold for `name` after every update so far."""
        if name not in self._view:
            raise CodecError(f"unknown tensor {name!r}; known: {sorted(self._view)}")
        return self._view[name]

    def residual(self, name: str, target: np.ndarray) -> np.ndarray:
        """`target - view(name)` in float32: what the next update still owes the receivers."""
        view = self.view(name)
        _check_float32(target, f"tensor {name!r}: target")
        if target.shape != view.shape:
            raise CodecError(
                f"tensor {name!r}: target has shape {target.shape}, the view has {view.shape}"
            )
        return np.subtract(target, view, out=np.empty(view.shape, dtype=np.float32))

    def encode_update(
        self, target: Mapping[str, np.ndarray], encoding: Encoding | str, density: float = 0.01
    ) -> dict[str, bytes]:
        """Payloads moving every receiver toward `target`; advances the view as they will."""
        unknown = sorted(set(target) - set(self._view))
        missing = sorted(set(self._view) - set(target))
        if unknown or missing:
            raise CodecError(
                f"update does not match the base: unknown tensors {unknown}, missing {missing}"
            )
        payloads = {
            name: encode(self.residual(name, target[name]), encoding, density=density, name=name)
            for name in self._view
        }
        self.advance(payloads, encoding)
        return payloads

    def advance(self, payloads: Mapping[str, bytes], encoding: Encoding | str) -> None:
        """Advance the view as receivers will on applying `payloads` (one per tensor)."""
        if set(payloads) != set(self._view):
            raise CodecError(f"an update must carry every tensor: missing {sorted(set(self._view) - set(payloads))}, "
                             f"unknown {sorted(set(payloads) - set(self._view))}")
        advanced = {name: _frozen(apply(view, payloads[name], encoding, name=name, bf16=self.bf16))
                    for name, view in self._view.items()}
        # Commit only once every tensor applied: advancing views for payloads that are never
        # returned would desynchronise us from the receivers for good.
        self._view.update(advanced)


def topk_count(n: int, density: float) -> int:
    """Entries a topk-int8 payload of an `n`-element tensor keeps."""
    return min(n, max(1, math.ceil(density * n)))


def _encode_topk(flat: np.ndarray, density: float, where: str) -> bytes:
    n = flat.size
    k = topk_count(n, density)
    # argpartition is deterministic for a given input, so ties resolve the same way every time.
    idx = np.sort(np.argpartition(np.abs(flat), n - k)[n - k :]) if 0 < k < n else np.arange(n)
    return topk_payload(idx, flat[idx], where)


def topk_payload(idx: np.ndarray, kept: np.ndarray, where: str = "tensor '?'", peak: float | None = None) -> bytes:
    """The topk-int8 payload keeping float32 values `kept` at flat indices `idx` (strictly
    increasing): what `encode` sends once it chose them. `peak`: the largest |value| the scale is
    set by, where `kept` is one shard's part of a tensor's entries (default: their own)."""
    k = idx.size
    if peak is None:
        peak = float(np.abs(kept).max()) if k else 0.0
    scale = np.float32(peak / _QMAX)
    if scale > 0:
        # float64 so that |q * scale - kept| <= scale / 2 holds before the final float32 rounding.
        ratio = kept.astype(np.float64) / np.float64(scale)
        q = np.clip(np.rint(ratio), -_QMAX, _QMAX).astype(_TOPK_VALUE)
    else:
        q = np.zeros(k, dtype=_TOPK_VALUE)
    _check_no_overflow(_dequantize(q, scale), kept, Encoding.TOPK_INT8, where)
    header = np.array([(k, scale)], dtype=_TOPK_HEADER)
    return header.tobytes() + idx.astype(_TOPK_INDEX).tobytes() + q.tobytes()


def topk_join(parts: Sequence[tuple[int, bytes]]) -> bytes:
    """One topk-int8 payload from (offset, payload) parts (ours, made with one scale) covering
    consecutive slices of a flat tensor in order: a sharded trainer's ranks encode their shards'
    parts of an update, and rank 0 publishes them joined."""
    head = _TOPK_HEADER.itemsize
    indices, values, total, scale = [], [], 0, np.float32(0)
    for offset, part in parts:
        header = np.frombuffer(part, dtype=_TOPK_HEADER, count=1)[0]
        k = int(header["k"])
        if k:
            scale = header["scale"]
        indices.append(np.frombuffer(part, dtype=_TOPK_INDEX, count=k, offset=head) + np.uint32(offset))
        values.append(np.frombuffer(part, dtype=_TOPK_VALUE, count=k, offset=head + k * _TOPK_INDEX.itemsize))
        total += k
    header = np.array([(total, scale)], dtype=_TOPK_HEADER)
    return header.tobytes() + b"".join(i.astype(_TOPK_INDEX).tobytes() for i in indices) + b"".join(
        v.tobytes() for v in values)


def _decode_topk(payload: bytes | bytearray, n: int, where: str) -> np.ndarray:
    """Flat float32 delta of `n` elements."""
    head = _TOPK_HEADER.itemsize
    if len(payload) < head:
        raise CodecError(
            f"{where}: payload has {len(payload)} bytes, shorter than the {head}-byte "
            "topk-int8 header"
        )
    header = np.frombuffer(payload, dtype=_TOPK_HEADER, count=1)[0]
    k, scale = int(header["k"]), header["scale"]
    if k > n:
        raise CodecError(f"{where}: topk-int8 k={k} exceeds the tensor's {n} elements")
    need = head + k * (_TOPK_INDEX.itemsize + _TOPK_VALUE.itemsize)
    if len(payload) != need:
        raise CodecError(
            f"{where}: payload has {len(payload)} bytes, topk-int8 with k={k} needs {need}"
        )
    if not (np.isfinite(scale) and scale >= 0):
        raise CodecError(f"{where}: topk-int8 scale is {float(scale)!r}, must be finite and >= 0")
    idx = np.frombuffer(payload, dtype=_TOPK_INDEX, count=k, offset=head)
    q = np.frombuffer(payload, dtype=_TOPK_VALUE, count=k, offset=head + k * _TOPK_INDEX.itemsize)
    steps = np.diff(idx.astype(np.int64))
    if (steps <= 0).any():
        at = int(np.flatnonzero(steps <= 0)[0]) + 1
        raise CodecError(
            f"{where}: topk-int8 indices must be strictly increasing; "
            f"index[{at}]={idx[at]} follows {idx[at - 1]}"
        )
    if k and idx[-1] >= n:
        raise CodecError(f"{where}: topk-int8 index {idx[-1]} is out of range for {n} elements")
    values = _dequantize(q, scale)
    _check_finite(values, f"{where}: topk-int8 payload (scale {float(scale)!r})")
    out = np.zeros(n, dtype=np.float32)
    out[idx] = values
    return out


def _encode_int4(flat: np.ndarray, where: str) -> bytes:
    n = flat.size
    blocks = -(-n // INT4_BLOCK)
    padded = np.zeros(blocks * INT4_BLOCK, dtype=np.float32)
    padded[:n] = flat
    rows = padded.reshape(blocks, INT4_BLOCK)
    scale = (np.abs(rows).max(axis=1) / np.float32(_Q4MAX)).astype(np.float32)  # (blocks,)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float64)
    q = np.clip(np.rint(rows / safe[:, None]), -_Q4MAX, _Q4MAX).astype(np.int8).ravel()[:n]
    _check_no_overflow(_dequantize_int4(q, scale), flat, Encoding.DENSE_INT4, where)
    nibbles = np.zeros(2 * (-(-n // 2)), dtype=np.uint8)
    nibbles[:n] = q.view(np.uint8) & np.uint8(0x0F)
    packed = nibbles[0::2] | (nibbles[1::2] << np.uint8(4))
    return scale.astype("<f4").tobytes() + packed.tobytes()


def _decode_int4(payload: bytes | bytearray, n: int, where: str) -> np.ndarray:
    blocks = -(-n // INT4_BLOCK)
    need = blocks * 4 + -(-n // 2)
    if len(payload) != need:
        raise CodecError(f"{where}: payload has {len(payload)} bytes, dense-int4 of {n} elements needs {need}")
    scale = np.frombuffer(payload, dtype="<f4", count=blocks)
    if not (np.isfinite(scale).all() and (scale >= 0).all()):
        bad = int(np.flatnonzero(~(np.isfinite(scale) & (scale >= 0)))[0])
        raise CodecError(f"{where}: dense-int4 scale {bad} is {float(scale[bad])!r}, must be finite and >= 0")
    packed = np.frombuffer(payload, dtype=np.uint8, offset=blocks * 4)
    nibbles = np.empty(2 * packed.size, dtype=np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & np.uint8(0x0F), packed >> np.uint8(4)
    q = ((nibbles[:n].astype(np.int8) ^ np.int8(8)) - np.int8(8)).astype(np.int8)  # sign-extend 4 bits
    values = _dequantize_int4(q, scale.astype(np.float32))
    _check_finite(values, f"{where}: dense-int4 payload")
    return values


def _dequantize_int4(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Flat float32 values of 4-bit `q` with one scale per block of INT4_BLOCK."""
    per_element = np.repeat(scale, INT4_BLOCK)[: q.size]
    with np.errstate(over="ignore"):
        return q.astype(np.float32) * per_element


def _encoding(encoding: Encoding | str) -> Encoding:
    try:
        return Encoding(encoding)
    except (ValueError, TypeError):
        known = ", ".join(e.value for e in Encoding)
        raise CodecError(f"unknown encoding {encoding!r}; expected one of {known}") from None


def _check_shape(shape: Sequence[int], where: str) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or len(shape) > _MAX_NDIM:
        raise CodecError(f"{where}: shape must be a tuple of <= {_MAX_NDIM} ints, got {shape!r}")
    for d in shape:
        is_int = isinstance(d, (int, np.integer)) and not isinstance(d, bool)
        if not is_int or not 0 <= d <= MAX_ELEMENTS:
            raise CodecError(f"{where}: shape {shape!r} has entry {d!r}, not an int in [0, 2**31]")
    dims = tuple(int(d) for d in shape)
    if math.prod(dims) > MAX_ELEMENTS:
        raise CodecError(f"{where}: shape {dims} has {math.prod(dims)} elements, over 2**31")
    return dims


def _check_float32(array: np.ndarray, what: str) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != np.float32:
        # repr of the type, not its name: a numpy scalar's name would read "float32".
        got = array.dtype if isinstance(array, np.ndarray) else repr(type(array))
        raise CodecError(f"{what} must be a float32 ndarray, got {got}")


def _check_finite(values: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise CodecError(f"{what} has {bad.size} non-finite values (first at flat index {bad[0]})")


def _check_no_overflow(decoded: np.ndarray, sent: np.ndarray, enc: Encoding, where: str) -> None:
    """Refuse here what every receiver would refuse, rather than ship it. Both arrays flat."""
    bad = np.flatnonzero(~np.isfinite(decoded))
    if bad.size:
        raise CodecError(
            f"{where}: delta value {float(sent[bad[0]])!r} overflows {enc.value}; "
            "send it as dense-fp32 or in smaller steps"
        )


def _dense_to_float32(wire: np.ndarray, enc: Encoding) -> np.ndarray:
    if enc is Encoding.DENSE_BF16:
        return bf16_bits_to_float32(wire)
    # float32 from a bytearray (`chunks.assemble`'s) is a view of it: a full-mode snapshot's
    # payload becomes the node's weights rather than being held twice while decoded. Bytes are
    # copied, so the array is always writable.
    return wire.astype(np.float32, copy=not wire.flags.writeable)


def _dequantize(q: np.ndarray, scale: np.float32) -> np.ndarray:
    with np.errstate(over="ignore"):  # an overflowing scale is rejected by the caller
        return q.astype(np.float32) * np.float32(scale)


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
