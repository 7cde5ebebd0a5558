"""Random weight blocks for synthetic models, and llama-quantize's per-tensor type rules they follow.

Quantized tensors are made directly as random blocks: the quant bytes are raw generator output (uniform,
which is a valid quant value for every nibble/int8); only each block's header (scales) is overwritten,
picked from a 256-entry table of valid headers by a random byte, so no float ever goes through a quantizer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from moestream.formats.gguf_write import TensorSpec

CHUNK_BYTES = 32 << 20  # per producer chunk: big enough to amortize numpy calls, small enough to queue

# ---- random blocks -------------------------------------------------------------------------------

# mean square of the integer part of each format for uniform random bits:
#   Q4_0: (q - 8), q uniform in 0..15          -> 21.5  (var 21.25 + mean^2 0.25)
#   Q8_0: int8 uniform in -128..127            -> 5461.5
#   Q4_K: sc*(q - 7.5) once dmin*m = 7.5*d*sc  -> 21.25 * sc^2
#   Q5_K: sc*(q - 15.5) once dmin*m = 15.5*d*sc -> 85.25 * sc^2
#   Q6_K: sc*(q - 32), q uniform in 0..63     -> 341.5 * sc^2
#   Q5_0: (q - 16), q uniform in 0..31         -> 85.5  (var 85.25 + mean^2 0.25)
#   Q5_1: q - 15.5 once m = -15.5*d            -> 85.25
_Q4_0_MS = 21.5
_Q5_0_MS = 85.5
_Q8_0_MS = 5461.5
_Q4_K_MS = 21.25
_Q5_K_MS = 85.25
_Q6_K_MS = 341.5
#   MXFP4: ggml's doubled e2m1 table (0, 1, 2, 3, 4, 6, 8, 12 and negatives) -> 34.25 times 2^(2(e-128))
_MXFP4_MS = 34.25

# elements and bytes per block, and the byte range of the header (scales) that the table overwrites
_BLOCK = {
    T.Q4_0: (32, 18, 0, 2),
    T.Q8_0: (32, 34, 0, 2),
    T.Q5_0: (32, 22, 0, 2),
    T.Q5_1: (32, 24, 0, 4),
    T.Q4_K: (256, 144, 0, 16),
    T.Q5_K: (256, 176, 0, 16),
    T.Q6_K: (256, 210, 192, 210),
}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose ffn_down gets more bits in Q4_K_M / Q5_K_M files: the first and
    last eighth, and every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


# llama-quantize's fallback for a tensor whose rows do not fill whole 256-value blocks (tensor_type_fallback)
_K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def fit_rows(ggml_type: T, row: int) -> T:
    """The type llama-quantize stores a tensor of row length `row` in when it wants `ggml_type`: a K-quant
    falls back to a 32-value type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0) when the row is not a multiple of
    256, as DeepSeek-V2-Lite's 1408-wide experts and every MLA attn_k_b (rows of qk_nope = 128) are."""
    if ggml_type in _K_FALLBACK and row % 256:
        return _K_FALLBACK[ggml_type]
    return ggml_type


def _f16_bits(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint16)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [..., 8] -> the 12 packed bytes of a Q4_K block (ggml's layout)."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return out


def header_table(ggml_type: T, std: float, rng: np.random.Generator) -> np.ndarray:
    """256 valid block headers (uint16 words) whose blocks have weight std `std` on average.

    The block scale varies by +-25% and flips sign, so the weights are zero-mean and not all alike.
    """
    mag = rng.uniform(0.75, 1.25, 256) * rng.choice([-1.0, 1.0], 256)
    if ggml_type in (T.Q4_0, T.Q8_0, T.Q5_0):
        ms = {T.Q4_0: _Q4_0_MS, T.Q8_0: _Q8_0_MS, T.Q5_0: _Q5_0_MS}[ggml_type]
        d = mag * (std / math.sqrt(ms * np.mean(mag**2)))
        return _f16_bits(d).reshape(256, 1)
    if ggml_type == T.Q5_1:
        d = mag * (std / math.sqrt(_Q5_K_MS * np.mean(mag**2)))
        return np.stack([_f16_bits(d), _f16_bits(-15.5 * d)], axis=1)
    if ggml_type == T.Q6_K:
        sc = rng.integers(16, 64, (256, 16))
        d = mag * (std / math.sqrt(_Q6_K_MS * np.mean(mag[:, None] ** 2 * sc**2)))
        hdr = np.empty((256, 18), np.uint8)
        hdr[:, 0:16] = sc.astype(np.int8).view(np.uint8)
        hdr[:, 16:18] = _f16_bits(d).view(np.uint8).reshape(256, 2)
        return hdr.view(np.uint16)
    if ggml_type in (T.Q4_K, T.Q5_K):
        # mins equal to the scales and dmin = 7.5*d (15.5*d) put every sub-block's zero at q = 7.5 (15.5), the
        # middle of its range (exact in f16)
        mid, ms = (7.5, _Q4_K_MS) if ggml_type == T.Q4_K else (15.5, _Q5_K_MS)
        sc = rng.integers(16, 64, (256, 8))
        d = mag * (std / math.sqrt(ms * np.mean(mag[:, None] ** 2 * sc**2)))
        hdr = np.empty((256, 16), np.uint8)
        hdr[:, 0:2] = _f16_bits(d).view(np.uint8).reshape(256, 2)
        hdr[:, 2:4] = _f16_bits(d * mid).view(np.uint8).reshape(256, 2)
        hdr[:, 4:16] = _pack_k_scales(sc, sc)
        return hdr.view(np.uint16)
    raise ValueError(f"no random-block generator for {ggml_type.name}")


def mxfp4_exponents(std: float, rng: np.random.Generator) -> np.ndarray:
    """256 valid MXFP4 block exponents (e8m0 bytes) whose blocks have weight std `std` on average.

    The scale is a power of two, so blocks take the two exponents around the wanted scale, in the share
    that makes the mean square exact (the e2m1 codes themselves are symmetric: zero-mean weights)."""
    want = std * std / _MXFP4_MS  # mean of 2^(2(e-128)) over the blocks
    k = math.floor(math.log(want, 4))
    share = (want / 4.0**k - 1.0) / 3.0  # of blocks at k + 1: 4^k (1 + 3 share) = want
    e = np.full(256, k + 128, np.int64)
    e[: round(256 * share)] += 1
    rng.shuffle(e)
    if e.min() < 1 or e.max() > 254:
        raise ValueError(f"weight std {std} is out of MXFP4's range")
    return e.astype(np.uint8)


def _random_mxfp4(n_elems: int, std: float, bitgen: np.random.SFC64) -> Iterator[np.ndarray]:
    """MXFP4 blocks ([e8m0][16 bytes of e2m1 pairs], 17 bytes): the first code byte picks the exponent."""
    table = mxfp4_exponents(std, np.random.Generator(np.random.SFC64(bitgen.random_raw())))
    n_blocks = n_elems // 32
    per_chunk = max(8, CHUNK_BYTES // 17 // 8 * 8)
    for start in range(0, n_blocks, per_chunk):
        nb = min(per_chunk, n_blocks - start)
        raw = bitgen.random_raw(-(-nb * 17 // 8)).view(np.uint8)[: nb * 17]
        b = raw.reshape(nb, 17)
        b[:, 0] = table[b[:, 1]]
        yield raw


def random_blocks(ggml_type: T, n_elems: int, std: float, seed: Any) -> Iterator[np.ndarray]:
    """Raw GGUF bytes of `n_elems` random weights with std ~`std`, in chunks of ~CHUNK_BYTES."""
    bitgen = np.random.SFC64(np.random.SeedSequence(seed))  # SFC64: a fast generator, read raw
    if ggml_type in (T.F32, T.F16, T.BF16):
        yield from _random_floats(ggml_type, n_elems, std, np.random.Generator(bitgen))
        return
    if ggml_type == T.MXFP4:
        yield from _random_mxfp4(n_elems, std, bitgen)
        return
    block, size, h0, h1 = _BLOCK[ggml_type]
    table = header_table(ggml_type, std, np.random.Generator(np.random.SFC64(bitgen.random_raw())))
    words = size // 2
    n_blocks = n_elems // block
    per_chunk = max(8, CHUNK_BYTES // size // 8 * 8)  # a multiple of 8 keeps chunks whole uint64s
    for start in range(0, n_blocks, per_chunk):
        nb = min(per_chunk, n_blocks - start)
        raw = bitgen.random_raw(-(-nb * size // 8)).view(np.uint8)[: nb * size]
        u = raw.view(np.uint16).reshape(nb, words)
        # the low byte of the block's (random) first word picks its header (never a header byte itself)
        u[:, h0 // 2 : h1 // 2] = table[u[:, 0].astype(np.uint8)]
        yield raw


def _random_floats(ggml_type: T, n_elems: int, std: float, rng: np.random.Generator) -> Iterator[np.ndarray]:
    a = std * math.sqrt(3.0)  # uniform(-a, a) has std a/sqrt(3); uniform floats cost far less than normals
    step = CHUNK_BYTES // 4
    for start in range(0, n_elems, step):
        x = rng.random(min(step, n_elems - start), dtype=np.float32)
        x *= 2 * a
        x -= a
        if ggml_type == T.F32:
            yield x
        elif ggml_type == T.F16:
            yield x.astype(np.float16)
        else:  # BF16: the top half of the float32 bits
            yield (x.view(np.uint32) >> 16).astype(np.uint16)


# ---- tensor specs --------------------------------------------------------------------------------


def spec(name: str, ggml_type: T, shape: tuple[int, ...], std: float, seed: int) -> TensorSpec:
    n = math.prod(shape)
    # one stream per tensor name: a 2-layer file has the same first two layers as the full model
    key = (seed, zlib.crc32(name.encode()))
    return TensorSpec(name, ggml_type, shape, lambda: random_blocks(ggml_type, n, std, key))


def uniform_spec(name: str, n: int, lo: float, hi: float, seed: int) -> TensorSpec:
    """A small F32 vector uniform in [lo, hi) (the converter writes 1-D tensors in F32)."""

    def produce() -> Iterator[np.ndarray]:
        rng = np.random.default_rng((seed, zlib.crc32(name.encode())))
        yield rng.uniform(lo, hi, n).astype(np.float32)

    return TensorSpec(name, T.F32, (n,), produce)


def norm_spec(name: str, n: int, seed: int) -> TensorSpec:
    # RMSNorm gains near 1 (F32, as the converter writes 1-D tensors)
    def produce() -> Iterator[np.ndarray]:
        rng = np.random.default_rng((seed, zlib.crc32(name.encode())))
        yield (1.0 + rng.uniform(-0.1, 0.1, n)).astype(np.float32)

    return TensorSpec(name, T.F32, (n,), produce)
