"""GGUF weight formats: block layouts, numpy decoders and the few encoders we need.

Every decoder works on a whole array of blocks at once (no Python loop over blocks). They are the
reference for the C decoders in `moestream.compute.native` and the path for small things (a handful of
embedding rows); the hot paths (experts, big dense weights) go through C.

Block layouts (llama.cpp ggml-common.h), one block = `BLOCK_SIZE` weights in `TYPE_SIZE` bytes:
  Q8_0  [d f16][qs i8 x32]                          w = d * q
  Q4_0  [d f16][qs u8 x16]                          w = d * (q - 8); q[j] low nibble, q[j+16] high
  Q4_1  [d f16][m f16][qs u8 x16]                   w = d * q + m
  Q5_0  [d f16][qh u32][qs u8 x16]                  w = d * (q - 16); bit j of qh = 5th bit of q[j]
  Q5_1  [d f16][m f16][qh u32][qs u8 x16]           w = d * q + m
  Q4_K  [d f16][dmin f16][scales 12][qs 128]        8 sub-blocks of 32: w = d*sc[j]*q - dmin*m[j]
  Q5_K  [d f16][dmin f16][scales 12][qh 32][qs 128] as Q4_K, 5th bit of sub-block j in bit j of qh
  Q6_K  [ql 128][qh 64][scales i8 x16][d f16]       16 groups of 16: w = d*sc[i]*(q - 32)

The 1- to 3-bit, IQ, ternary and MXFP4 types are decoded by `lowbit` (same interface, registered below).

FP8_B128 is no GGUF type: a checkpoint's FP8 e4m3 weights with their block scales, as the FP8 compute form
keeps them (native/fp8.c), an id beyond GGML's so that the two cannot clash:
  FP8_B128 [scale f32][e4m3 u8 x128]                w = e4m3(q) * scale
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from moestream.errors import ModelFileError
from moestream.formats import lowbit

QK_K = 256
FP8_B128 = 0x10F8  # checkpoint FP8 (see above); GGML's type ids are below 64

# (weights per block, bytes per block)
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    T.F32: (1, 4),
    T.F16: (1, 2),
    T.BF16: (1, 2),
    T.Q8_0: (32, 34),
    T.Q4_0: (32, 18),
    T.Q4_1: (32, 20),
    T.Q5_0: (32, 22),
    T.Q5_1: (32, 24),
    T.Q4_K: (256, 144),
    T.Q5_K: (256, 176),
    T.Q6_K: (256, 210),
    **lowbit.BLOCK_SIZES,
    FP8_B128: (128, 132),
}

SUPPORTED_TYPES: frozenset[int] = frozenset(int(t) for t in BLOCK_SIZES)
QUANTIZE_TYPES: frozenset[int] = frozenset(
    int(t) for t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q6_K)
)


def type_name(ggml_type: int) -> str:
    if ggml_type == FP8_B128:
        return "FP8_E4M3 (block scales)"
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _check_type(ggml_type: int) -> tuple[int, int]:
    if ggml_type not in BLOCK_SIZES:
        supported = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
        raise ModelFileError(
            f"weights of GGUF type {type_name(ggml_type)} are not supported (supported: {supported}); "
            "use a model in one of those types"
        )
    return BLOCK_SIZES[ggml_type]


def tensor_nbytes(ggml_type: int, n_elems: int) -> int:
    block, size = _check_type(ggml_type)
    if n_elems % block:
        raise ValueError(f"{type_name(ggml_type)} needs a multiple of {block} weights, got {n_elems}")
    return n_elems // block * size


def row_nbytes(ggml_type: int, n_cols: int) -> int:
    """Bytes of one row of `n_cols` weights (rows never share a block)."""
    return tensor_nbytes(ggml_type, n_cols)


# ---------------------------------------------------------------------------------------------------------
# decoders: blocks [n, TYPE_SIZE] uint8 -> [n, BLOCK_SIZE] float32


def _f16(b: np.ndarray) -> np.ndarray:
    """Two-byte columns [n, 2] holding a little-endian fp16 -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _dq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, :2])
    return np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32) * d


def _dq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, :2])
    qs = b[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: qh [n, 4] (little-endian bit j = high bit of weight j), qs [n, 16] -> q [n, 32] in 0..31."""
    hi = np.unpackbits(qh, axis=1, bitorder="little")
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (hi << 4)


def _dq_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    qs = b[:, 4:]
    return d * np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) + m


def _dq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = _q5_values(b[:, 2:6], b[:, 6:]).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _dq_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * _q5_values(b[:, 4:8], b[:, 8:]).astype(np.float32) + m


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte Q4_K/Q5_K field into 8 six-bit scales and 8 six-bit mins ([n, 8] uint8 each).

    bytes 0-3: low 6 bits sc[0..3], top 2 bits = high bits of sc[4..7]
    bytes 4-7: low 6 bits m[0..3],  top 2 bits = high bits of m[4..7]
    bytes 8-11: low nibble = low 4 bits of sc[4..7], high nibble = low 4 bits of m[4..7]
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def pack_k_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of k_scale_min: sc, mn [n, 8] in 0..63 -> [n, 12] uint8."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [n, 128] -> [n, 8, 32]: sub-block 2c = low nibbles of qs[32c:32c+32], 2c+1 = high."""
    qs = qs.reshape(-1, 4, 1, 32)
    return ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)


def _dq_q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_scale_min(b[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    q = k_nibbles(b[:, 16:144]).astype(np.float32)
    return (scale * q - offset).reshape(-1, QK_K)


def _dq_q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_scale_min(b[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (k_nibbles(b[:, 48:176]) | ((qh & 1) << 4)).astype(np.float32)
    return (scale * q - offset).reshape(-1, QK_K)


def _q6_k_values(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """ql [n, 128], qh [n, 64] -> 6-bit q [n, 256] uint8.

    Each half of 128 weights uses 64 ql bytes and 32 qh bytes: weight 32t + l (t = 0..3) takes nibble t // 2
    of ql[32 * (t % 2) + l] and bits 2t..2t+1 of qh[l].
    """
    ql = ql.reshape(-1, 2, 1, 2, 32)  # half, nibble, t % 2, l
    lo = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)) & 0x0F
    lo = lo.reshape(-1, 2, 4, 32)  # t = 2 * nibble + t % 2
    hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
    return (lo | (hi << 4)).reshape(-1, QK_K)


def _dq_q6_k(b: np.ndarray) -> np.ndarray:
    q = _q6_k_values(b[:, 0:128], b[:, 128:192]).astype(np.int8) - np.int8(32)
    scale = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    return ((d * scale)[:, :, None] * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


def _e4m3_table() -> np.ndarray:
    """e4m3fn byte -> float32: 4 exponent bits (bias 7), 3 mantissa bits, exponent 0 subnormal, S.1111.111 NaN."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float32)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0)).astype(np.float32)
    v[(b & 0x7F) == 0x7F] = np.nan
    return np.where(b & 0x80, -v, v).astype(np.float32)


E4M3 = _e4m3_table()


def _dq_fp8_b128(b: np.ndarray) -> np.ndarray:
    return E4M3[b[:, 4:]] * b[:, :4].copy().view(np.float32)


_BLOCK_DECODERS = {
    FP8_B128: _dq_fp8_b128,
    T.Q8_0: _dq_q8_0,
    T.Q4_0: _dq_q4_0,
    T.Q4_1: _dq_q4_1,
    T.Q5_0: _dq_q5_0,
    T.Q5_1: _dq_q5_1,
    T.Q4_K: _dq_q4_k,
    T.Q5_K: _dq_q5_k,
    T.Q6_K: _dq_q6_k,
    **lowbit.DECODERS,
}


def as_bytes(raw: np.ndarray | memoryview | bytes | bytearray) -> np.ndarray:
    """Any buffer -> flat uint8 array (no copy)."""
    if isinstance(raw, np.ndarray):
        return raw.reshape(-1).view(np.uint8)
    return np.frombuffer(raw, dtype=np.uint8)


def _decode_flat(raw: np.ndarray, ggml_type: int, n_elems: int) -> np.ndarray:
    block, size = _check_type(ggml_type)
    nbytes = tensor_nbytes(ggml_type, n_elems)
    if raw.size < nbytes:
        raise ValueError(f"{type_name(ggml_type)}: {n_elems} weights need {nbytes} bytes, got {raw.size}")
    raw = raw[:nbytes]
    if ggml_type == T.F32:
        return raw.view(np.float32).copy()
    if ggml_type == T.F16:
        return raw.view(np.float16).astype(np.float32)
    if ggml_type == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    blocks = raw.reshape(-1, size)
    out = np.empty((blocks.shape[0], block), np.float32)
    # chunks keep the temporaries in cache; each chunk is still fully vectorised
    step = 1 << 14
    # a damaged file's scales may be NaN/inf: its values are then too, which the router check reports in one
    # line; numpy's warnings about it would only add noise to that line
    with np.errstate(all="ignore"):
        for i in range(0, blocks.shape[0], step):
            out[i : i + step] = _BLOCK_DECODERS[ggml_type](blocks[i : i + step])
    return out.reshape(-1)


def dequantize(raw: np.ndarray | memoryview, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """GGUF bytes -> float32 array of `shape` (numpy order: the last dimension is contiguous)."""
    n = int(np.prod(shape, dtype=np.int64))
    return _decode_flat(as_bytes(raw), ggml_type, n).reshape(shape)


def dequantize_rows(
    raw: np.ndarray | memoryview, ggml_type: int, n_cols: int, rows: np.ndarray | Sequence[int]
) -> np.ndarray:
    """Decode only `rows` of a [n_rows, n_cols] matrix -> float32 [len(rows), n_cols] (embedding lookup)."""
    raw = as_bytes(raw)
    rb = row_nbytes(ggml_type, n_cols)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    n_rows = raw.size // rb
    if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
        raise IndexError(f"row index out of range for a matrix of {n_rows} rows")
    picked = raw[: n_rows * rb].reshape(n_rows, rb)[rows]
    return _decode_flat(picked.reshape(-1), ggml_type, rows.size * n_cols).reshape(rows.size, n_cols)


# byte offsets of the fp16 scale fields in each block type
_FP16_FIELDS = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def random_gguf(ggml_type: int, n_elems: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid GGUF bytes for tests: every bit pattern is a valid code except the fp16 scales,
    which must be finite, so those are drawn from a normal distribution."""
    block, size = _check_type(ggml_type)
    if ggml_type == T.F32:
        return rng.standard_normal(n_elems).astype(np.float32).view(np.uint8)
    if ggml_type == T.F16:
        return rng.standard_normal(n_elems).astype(np.float16).view(np.uint8)
    if ggml_type == T.BF16:
        bits = rng.standard_normal(n_elems).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    b = rng.integers(0, 256, (n_elems // block, size), dtype=np.uint8)
    if ggml_type in lowbit.DECODERS:
        lowbit.fix_random_blocks(ggml_type, b, rng.standard_normal(b.shape[0]))
        return b.reshape(-1)
    for off in _FP16_FIELDS[ggml_type]:
        b[:, off : off + 2] = rng.standard_normal((b.shape[0], 1)).astype(np.float16).view(np.uint8)
    return b.reshape(-1)


# ---------------------------------------------------------------------------------------------------------
# encoders (used to write test models and by the quantize tool; never on the inference path)


def _round(x: np.ndarray) -> np.ndarray:
    # half away from zero, like llama.cpp's nearest_int on the values we feed it
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _f16_up(x: np.ndarray) -> np.ndarray:
    """x >= 0 -> the smallest float16 >= x, so that x / result never exceeds the integer range it was
    sized for (plain rounding can go down, and a 6- or 8-bit code would then clip)."""
    y = x.astype(np.float16)
    low = y.astype(np.float64) < x
    return np.where(low, np.nextafter(y, np.float16(np.inf)), y)


def _fit_min_scale(x: np.ndarray, nmax: int, n_grid: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [n, g]: scale >= 0 and offset <= 0 so that x ~ scale * q + offset, q in 0..nmax.

    Start from the min/max fit, then try a grid of slightly different scales; for each, round, refit
    scale and offset by least squares on the chosen q, and keep the fit with the lowest squared error.
    The offset stays <= 0 because Q4_K stores it as an unsigned 'min' that is subtracted.
    """
    lo = np.minimum(x.min(axis=1), 0.0)
    hi = x.max(axis=1)
    span = hi - lo
    safe = np.where(span > 0, span, 1.0)
    best_s = span / nmax
    best_o = lo.copy()
    best_err = _fit_err(x, best_s, best_o, nmax)
    g = x.shape[1]
    for step in np.linspace(-1.0, 1.0, n_grid):
        inv = (nmax + step) / safe
        q = np.clip(_round((x - lo[:, None]) * inv[:, None]), 0, nmax)
        # least squares for x ~ s*q + o
        sq, sx = q.sum(1), x.sum(1)
        sqq, sqx = (q * q).sum(1), (q * x).sum(1)
        det = g * sqq - sq * sq
        ok = det > 0
        s = np.where(ok, (g * sqx - sq * sx) / np.where(ok, det, 1.0), 0.0)
        o = np.where(ok, (sqq * sx - sq * sqx) / np.where(ok, det, 1.0), 0.0)
        # a positive offset cannot be stored: pin it to 0 and refit the scale alone
        pos = o > 0
        s = np.where(pos, sqx / np.where(sqq > 0, sqq, 1.0), s)
        o = np.where(pos, 0.0, o)
        s = np.maximum(s, 0.0)
        err = _fit_err(x, s, o, nmax)
        better = err < best_err
        best_s = np.where(better, s, best_s)
        best_o = np.where(better, o, best_o)
        best_err = np.where(better, err, best_err)
    return best_s.astype(np.float32), best_o.astype(np.float32)


def _fit_err(x: np.ndarray, s: np.ndarray, o: np.ndarray, nmax: int) -> np.ndarray:
    inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0)
    q = np.clip(_round((x - o[:, None]) * inv[:, None]), 0, nmax)
    return ((s[:, None] * q + o[:, None] - x) ** 2).sum(1)


def _q4_k_encode(w: np.ndarray, search: bool = True) -> np.ndarray:
    """float32 [n_blocks, 256] -> Q4_K blocks [n_blocks, 144]. search=False is the plain min/max fit."""
    n = w.shape[0]
    sub = w.reshape(n * 8, 32).astype(np.float64)
    if search:
        s, o = _fit_min_scale(sub, 15)
    else:
        lo = np.minimum(sub.min(1), 0.0)
        s, o = ((sub.max(1) - lo) / 15).astype(np.float32), lo.astype(np.float32)
    s, m = s.reshape(n, 8), (-o).reshape(n, 8)
    # super-block scales: 6-bit sub-block scales/mins relative to the largest one
    d = _f16_up(s.max(1) / 63)
    dmin = _f16_up(m.max(1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_round(np.where(d32 > 0, s / d32, 0)), 0, 63)
        mn = np.clip(_round(np.where(dmin32 > 0, m / dmin32, 0)), 0, 63)
    # final codes from the scales as they will be decoded
    scale = (d32 * sc).reshape(n * 8, 1)
    offset = (dmin32 * mn).reshape(n * 8, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, _round((sub + offset) / np.where(scale > 0, scale, 1)), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    out = np.empty((n, 144), np.uint8)
    out[:, 0:2] = d.reshape(n, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(n, 1).view(np.uint8)
    out[:, 4:16] = pack_k_scale_min(sc, mn)
    out[:, 16:] = qs
    return out


def _q6_k_encode(w: np.ndarray) -> np.ndarray:
    """float32 [n_blocks, 256] -> Q6_K blocks [n_blocks, 210]: absmax per group of 16, int8 group scales."""
    n = w.shape[0]
    g = w.reshape(n, 16, 16).astype(np.float64)
    # map the largest-magnitude weight onto -32 (the asymmetric end of -32..31) so no range is wasted
    imax = np.abs(g).argmax(axis=2)[..., None]
    s = -np.take_along_axis(g, imax, axis=2)[..., 0] / 32  # [n, 16]
    d = _f16_up(np.abs(s).max(1) / 127)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_round(np.where(d32 > 0, s / d32, 0)), -128, 127)
    scale = (d32 * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale != 0, _round(g / np.where(scale != 0, scale, 1)), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # half, t, l
    lo, hi = q & 0x0F, q >> 4
    ql = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(n, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    out = np.empty((n, 210), np.uint8)
    out[:, 0:128] = ql
    out[:, 128:192] = qh
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.reshape(n, 1).view(np.uint8)
    return out


def quantize(w: np.ndarray, ggml_type: int) -> np.ndarray:
    """float32 [..., K] -> GGUF bytes uint8 [..., K / BLOCK_SIZE * TYPE_SIZE]."""
    block, size = _check_type(ggml_type)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.shape[-1] % block:
        raise ValueError(f"{type_name(ggml_type)} needs rows that are a multiple of {block}, got {w.shape[-1]}")
    out_shape = (*w.shape[:-1], w.shape[-1] // block * size)
    if ggml_type == T.F32:
        return w.view(np.uint8).reshape(out_shape)
    if ggml_type == T.F16:
        return w.astype(np.float16).view(np.uint8).reshape(out_shape)
    if ggml_type in (T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        return np.asarray(gq.quantize(w, T(ggml_type))).view(np.uint8).reshape(out_shape)
    if ggml_type in (T.Q4_K, T.Q6_K):
        encode = _q4_k_encode if ggml_type == T.Q4_K else _q6_k_encode
        blocks = w.reshape(-1, QK_K)
        out = np.empty((blocks.shape[0], size), np.uint8)
        step = 1 << 12  # bounds the float64 temporaries of the search
        for i in range(0, blocks.shape[0], step):
            out[i : i + step] = encode(blocks[i : i + step])
        return out.reshape(out_shape)
    raise NotImplementedError(f"no encoder for {type_name(ggml_type)}")
