"""Decoders of the 1- to 3-bit and non-linear GGUF types (what DeepSeek, GLM and Kimi files come in at 2-4 bits).

numpy, vectorised over whole arrays of blocks, each computing in the order of ggml's reference decoder
(dequantize_row_* in ggml-quants.c) so that the result is bit for bit the same. The codebooks of the IQ
types (the 'grids' of 4 or 8 values an index selects, the sign patterns, the non-linear 4-bit values) are
data, not code: they come from the gguf package at import time.

Block layouts (llama.cpp ggml-common.h), super-blocks of 256 weights unless said otherwise:
  Q2_K    [scales 16][qs 64][d f16][dmin f16]            16 groups of 16: w = d*(s&15)*q - dmin*(s>>4), q 2 bits
  Q3_K    [hmask 32][qs 64][scales 12][d f16]            16 groups of 16: w = d*(sc-32)*(q - 4*!hbit)
  IQ4_NL  (32)  [d f16][qs 16]                           w = d*kvalues[q]
  IQ4_XS  [d f16][scales_h u16][scales_l 4][qs 128]      8 groups of 32: w = d*(ls-32)*kvalues[q]
  IQ2_XXS [d f16][qs u32 x16]                            per 32: 4 grid bytes, 4x7 sign bits, 4-bit scale
  IQ2_XS  [d f16][qs u16 x32][scales 8]                  per 8: 9-bit grid index, 7-bit sign index
  IQ2_S   [d f16][qs 32][signs 32][qh 8][scales 8]       per 8: 10-bit grid index, 8 sign bits
  IQ3_XXS [d f16][qs 64][scales_signs u32 x8]            per 4: 8-bit grid index; per 32: signs, scale
  IQ3_S   [d f16][qs 64][qh 8][signs 32][scales 4]       per 4: 9-bit grid index; explicit sign bits
  IQ1_S   [d f16][qs 32][qh u16 x8]                      per 8: 11-bit index into a {-1,0,1} grid, +-delta
  IQ1_M   [qs 32][qh 16][scales u16 x4]                  as IQ1_S, d split over the scales' top nibbles
  TQ1_0   [qs 48][qh 4][d f16]                           ternary, 5 (qs) or 4 (qh) trits per byte
  TQ2_0   [qs 64][d f16]                                 ternary, 2 bits each: w = d*(q-1)
  MXFP4   (32)  [e u8][qs 16]                            w = 2^(e-128) * e2m1 value (doubled table)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

QK_K = 256
F = np.float32


def _grid(cls: type) -> np.ndarray:
    """The codebook of an IQ type from the gguf package: float32 [entries, values per entry]."""
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=F)


IQ2XXS_GRID = _grid(gq.IQ2_XXS)
IQ2XS_GRID = _grid(gq.IQ2_XS)
IQ2S_GRID = _grid(gq.IQ2_S)
IQ3XXS_GRID = _grid(gq.IQ3_XXS)
IQ3S_GRID = _grid(gq.IQ3_S)
IQ1S_GRID = _grid(gq.IQ1_S)
# sign patterns: entry i = the 8 signs (+1/-1) of an index whose bit j negates value j
_KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
KSIGNS = np.where((_KSIGNS[:, None] >> np.arange(8, dtype=np.uint8)) & 1, F(-1), F(1))
IQ4NL_VALUES = np.array(gq.IQ4_NL.kvalues, dtype=np.int8)
MXFP4_VALUES = np.array(gq.MXFP4.kvalues, dtype=np.int8)
IQ1_DELTA = F(0.125)

_BITS8 = np.arange(8, dtype=np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes of a little-endian fp16 -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(F)


def _u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u2")


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4")


def _bits(b: np.ndarray) -> np.ndarray:
    """[n, m] bytes -> [n, m, 8] of their bits, least significant first."""
    return (b[..., None] >> _BITS8) & 1


def _signs(bits: np.ndarray) -> np.ndarray:
    return np.where(bits != 0, F(-1), F(1))


def dq_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (sc & 0x0F).astype(F))[:, :, None]
    ml = (dmin * (sc >> 4).astype(F))[:, :, None]
    # weight 128h + 32j + l is bits 2j..2j+1 of qs[32h + l]; its group of 16 is 8h + 2j + l // 16
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return (dl * q.reshape(n, 16, 16).astype(F) - ml).reshape(n, QK_K)


def q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes -> 16 signed scales (sc - 32) [n, 16] int8: low nibbles from bytes 0-7 (byte i
    then byte i's high nibble for scale i + 8), top two bits from bytes 8-11 (bits 2j of byte 8 + i % 4 for
    scale 4j + i % 4)."""
    n = s.shape[0]
    lo = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    hi = (s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3
    return (lo | (hi.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)


def dq_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask, qs, d = b[:, 0:32], b[:, 32:96], _f16(b[:, 108:110])
    dl = (d * q3_k_scales(b[:, 96:108]).astype(F))[:, :, None]
    # weight 128h + 32j + l: bits 2j of qs[32h + l], high bit (4h + j) of hmask[l]; a clear high bit means -4
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    hb = (hmask.reshape(n, 1, 32) >> _BITS8.reshape(1, 8, 1)) & 1
    q = ql.reshape(n, 8, 32).astype(np.int8) - ((hb ^ 1) << 2).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(F)).reshape(n, QK_K)


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the 16 low nibbles, then the 16 high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def dq_iq4_nl(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, 0:2]) * IQ4NL_VALUES[_nibbles16(b[:, 2:18])].astype(F)


def iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks -> the 8 signed 6-bit sub-block scales (ls - 32) [n, 8] int8."""
    n = b.shape[0]
    sh = _u16(b[:, 2:4])  # [n, 1]
    lo = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=2).reshape(n, 8)
    hi = ((sh >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    return (lo | (hi << 4)).astype(np.int8) - np.int8(32)


def dq_iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = (_f16(b[:, 0:2]) * iq4_xs_scales(b).astype(F))[:, :, None]
    q = _nibbles16(b[:, 8:136].reshape(n, 8, 16))
    return (dl * IQ4NL_VALUES[q].astype(F)).reshape(n, QK_K)


def _half_scales(d: np.ndarray, scales: np.ndarray, mul: F) -> np.ndarray:
    """IQ2_XS/IQ2_S: a 4-bit scale per 16 weights (low nibble, then high) -> d*(0.5+s)*mul [n, 16]."""
    s = np.stack([scales & 0x0F, scales >> 4], axis=2).reshape(scales.shape[0], -1)
    return d * (F(0.5) + s.astype(F)) * mul


def dq_iq2_xxs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    aux = _u32(b[:, 2:66]).reshape(n, 8, 2)
    db = (d * (F(0.5) + (aux[:, :, 1] >> 28).astype(F)) * F(0.25))[:, :, None, None]
    idx = b[:, 2:66].reshape(n, 8, 8)[:, :, 0:4]  # the 4 grid bytes of each sub-block's first word
    sidx = (aux[:, :, 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F
    return (db * IQ2XXS_GRID[idx] * KSIGNS[sidx]).reshape(n, QK_K)


def dq_iq2_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qs = _u16(b[:, 2:66]).reshape(n, 16, 2)
    db = _half_scales(d, b[:, 66:74], F(0.25))[:, :, None, None]
    return (db * IQ2XS_GRID[qs & 511] * KSIGNS[qs >> 9]).reshape(n, QK_K)


def dq_iq2_s(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qh = (b[:, 66:74, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # [n, 8, 4]
    idx = b[:, 2:34].astype(np.uint16) | (qh.reshape(n, 32).astype(np.uint16) << 8)
    signs = _signs(_bits(b[:, 34:66]))  # [n, 32, 8]
    db = _half_scales(d, b[:, 74:82], F(0.25))[:, :, None, None]
    return (db * IQ2S_GRID[idx].reshape(n, 16, 2, 8) * signs.reshape(n, 16, 2, 8)).reshape(n, QK_K)


def dq_iq3_xxs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    aux = _u32(b[:, 66:98])  # [n, 8]
    db = (d * (F(0.5) + (aux >> 28).astype(F)) * F(0.5))[:, :, None, None]
    grid = IQ3XXS_GRID[b[:, 2:66]].reshape(n, 8, 4, 8)  # two 4-value entries per 8 weights
    sidx = (aux[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F
    return (db * grid * KSIGNS[sidx]).reshape(n, QK_K)


def dq_iq3_s(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    idx = b[:, 2:66].astype(np.uint16) | (_bits(b[:, 66:74]).reshape(n, 64).astype(np.uint16) << 8)
    signs = _signs(_bits(b[:, 74:106])).reshape(n, 8, 32)
    s = np.stack([b[:, 106:110] & 0x0F, b[:, 106:110] >> 4], axis=2).reshape(n, 8)
    db = (d * (1 + 2 * s))[:, :, None]
    return (db * IQ3S_GRID[idx].reshape(n, 8, 32) * signs).reshape(n, QK_K)


def dq_iq1_s(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qh = _u16(b[:, 34:50])  # [n, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1))[:, :, None, None]
    delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA)[:, :, None, None]
    hi = (qh[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
    idx = b[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | (hi << 8)
    return (dl * (IQ1S_GRID[idx] + delta)).reshape(n, QK_K)


def iq1_m_scale(b: np.ndarray) -> np.ndarray:
    """IQ1_M's fp16 super-block scale, kept in the top nibble of each of its 4 u16 scale words -> [n, 1]."""
    sc = _u16(b[:, 48:56])
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    return bits.astype(np.uint16).view(np.float16).astype(F)[:, None]


def dq_iq1_m(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = iq1_m_scale(b)
    sc = _u16(b[:, 48:56])
    s = ((sc[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(n, 16)  # per 16 weights
    dl = (d * (2 * s + 1)).reshape(n, 16, 1, 1)
    qh = np.stack([b[:, 32:48] & 0x0F, b[:, 32:48] >> 4], axis=2).reshape(n, 32)  # per 8 weights
    idx = b[:, 0:32].astype(np.uint16) | ((qh & 7).astype(np.uint16) << 8)
    delta = np.where(qh & 8, -IQ1_DELTA, IQ1_DELTA).reshape(n, 16, 2, 1)
    return (dl * (IQ1S_GRID[idx].reshape(n, 16, 2, 8) + delta)).reshape(n, QK_K)


def _trits(q: np.ndarray, powers: list[int]) -> np.ndarray:
    """TQ1_0 bytes [n, m] -> trits [n, len(powers), m] in -1..1 (byte * 3^i keeps trit i in its top bits)."""
    p = np.array(powers, np.uint8).reshape(1, -1, 1)
    x = (q[:, None, :] * p).astype(np.uint16)  # uint8 product wraps, as in C
    return ((x * 3) >> 8).astype(np.int8) - np.int8(1)


def dq_tq1_0(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 52:54])
    five = [1, 3, 9, 27, 81]
    q = np.concatenate(
        [
            _trits(b[:, 0:32], five).reshape(n, 160),
            _trits(b[:, 32:48], five).reshape(n, 80),
            _trits(b[:, 48:52], five[:4]).reshape(n, 16),
        ],
        axis=1,
    )
    return q.astype(F) * d


def dq_tq2_0(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    q = (b[:, 0:64].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return (q.reshape(n, QK_K).astype(np.int8) - np.int8(1)).astype(F) * _f16(b[:, 64:66])


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's shared exponent byte -> 2^(e - 128) as float32 (half the scale: the value table is doubled)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(F)


def dq_mxfp4(b: np.ndarray) -> np.ndarray:
    return e8m0_half(b[:, 0:1]) * MXFP4_VALUES[_nibbles16(b[:, 1:17])].astype(F)


DECODERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    int(T.Q2_K): dq_q2_k,
    int(T.Q3_K): dq_q3_k,
    int(T.IQ4_NL): dq_iq4_nl,
    int(T.IQ4_XS): dq_iq4_xs,
    int(T.IQ2_XXS): dq_iq2_xxs,
    int(T.IQ2_XS): dq_iq2_xs,
    int(T.IQ2_S): dq_iq2_s,
    int(T.IQ3_XXS): dq_iq3_xxs,
    int(T.IQ3_S): dq_iq3_s,
    int(T.IQ1_S): dq_iq1_s,
    int(T.IQ1_M): dq_iq1_m,
    int(T.TQ1_0): dq_tq1_0,
    int(T.TQ2_0): dq_tq2_0,
    int(T.MXFP4): dq_mxfp4,
}

BLOCK_SIZES: dict[int, tuple[int, int]] = {t: tuple(GGML_QUANT_SIZES[T(t)]) for t in DECODERS}  # type: ignore[misc]

# byte offsets of each type's fp16 fields (random test blocks keep those finite)
FP16_FIELDS: dict[int, tuple[int, ...]] = {
    int(T.Q2_K): (80, 82),
    int(T.Q3_K): (108,),
    int(T.IQ4_NL): (0,),
    int(T.IQ4_XS): (0,),
    int(T.IQ2_XXS): (0,),
    int(T.IQ2_XS): (0,),
    int(T.IQ2_S): (0,),
    int(T.IQ3_XXS): (0,),
    int(T.IQ3_S): (0,),
    int(T.IQ1_S): (0,),
    int(T.IQ1_M): (),
    int(T.TQ1_0): (52,),
    int(T.TQ2_0): (64,),
    int(T.MXFP4): (),
}


def fix_random_blocks(ggml_type: int, b: np.ndarray, scale: np.ndarray) -> None:
    """Make random bytes [n, size] valid blocks of `ggml_type`: its scales set from float16 `scale` [n]."""
    for off in FP16_FIELDS[ggml_type]:
        b[:, off : off + 2] = scale.astype(np.float16).reshape(-1, 1).view(np.uint8)
    if ggml_type == T.IQ1_M:  # the fp16 is split over the top nibbles of the four scale words
        bits = scale.astype(np.float16).view(np.uint16).astype(np.uint16)
        sc = _u16(b[:, 48:56]).copy() & np.uint16(0x0FFF)
        for i in range(4):
            sc[:, i] |= ((bits >> (4 * i)) & 0xF) << 12
        b[:, 48:56] = sc.view(np.uint8)
    elif ggml_type == T.MXFP4:  # an exponent near 2^0 keeps every value finite
        b[:, 0] = np.clip(np.rint(np.log2(np.maximum(np.abs(scale), 1e-30))) + 128, 100, 140).astype(np.uint8)
