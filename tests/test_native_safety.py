"""The native kernels cannot be driven out of bounds: every entry point refuses bad sizes, counts and pointers
with a code the Python side raises, and garbage weight bytes (NaN/inf scales included) are read and written
in bounds. The hostile calls run once more against a build with AddressSanitizer and UBSan."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moestream.compute import linear, native
from moestream.errors import ComputeError, ModelFileError
from moestream.formats import quants
from moestream.models.ops import add_weighted_rows, rms_norm
from moestream.models.routing import route_topk
from tests.fuzz.gguf_cases import load_seeds, make_case, materialize, write_seeds

needs_native = pytest.mark.skipif(native.lib() is None, reason="needs the native library (a C compiler)")
ROOT = Path(__file__).resolve().parents[1]
SANITIZE = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g", "-O1")

# Run in a child process against the library at sys.argv[1]. Each hostile call must either be refused with
# ComputeError or complete; what completes must write only where it should (ids in range, guard bytes intact).
HOSTILE = r"""
import ctypes, sys
import numpy as np
from moestream.compute import native
from moestream.errors import ComputeError

lib = native.load_library(sys.argv[1])
lib.ms_set_threads(2)
rng = np.random.default_rng(0)
BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
          12: (256, 144), 13: (256, 176), 14: (256, 210), 39: (32, 17)}
LANE = (2, 8, 12, 13, 14, 6, 7, 39)
PER32 = (2, 8, 6, 7, 39)  # lane types whose rows need only be whole 32-blocks
refused = done = 0


def ptr(a):
    return a.ctypes.data


def garbage(t, n_elems):
    block, size = BLOCKS[t]
    return rng.integers(0, 256, n_elems // block * size, dtype=np.uint8)


def call(fn, *args, want=None):
    global refused, done
    try:
        fn(*args)
        done += 1
        assert want is None, f"{fn.__name__}{args} accepted, wanted code {want}"
    except ComputeError as exc:
        refused += 1
        assert want is None or exc.code == want, (exc, want)


# router: NaN/inf logits, k out of range, empty and null inputs
for row in ([np.nan] * 16, [np.inf] * 16, [-np.inf] * 16, [0.0] * 15 + [np.nan], [1.0] * 8 + [np.inf] * 8,
            list(rng.standard_normal(16))):
    logits = np.array([row, row], np.float32)
    ids = np.full(2 * 4 + 8, -7, np.int64)
    w = np.full(2 * 4 + 8, -7, np.float32)
    finite = bool(np.isfinite(logits).all())
    call(lib.ms_route_topk, ptr(logits), 2, 16, 4, 1, ptr(ids), ptr(w), want=None if finite else native.NOT_FINITE)
    assert ((ids[:8] >= 0) & (ids[:8] < 16)).all() and (ids[8:] == -7).all() and (w[8:] == -7).all(), ids
logits = rng.standard_normal(16).astype(np.float32)
ids, w = np.zeros(32, np.int64), np.zeros(32, np.float32)
for t, e, k in ((1, 16, 17), (1, 16, 0), (1, 0, 1), (-1, 16, 4), (1, -16, 4), (1 << 40, 16, 4)):
    call(lib.ms_route_topk, ptr(logits), t, e, k, 1, ptr(ids), ptr(w), want=native.BAD_SHAPE)
call(lib.ms_route_topk, None, 1, 16, 4, 1, ptr(ids), ptr(w), want=native.BAD_PTR)
call(lib.ms_route_topk, ptr(logits), 0, 16, 4, 1, ptr(ids), ptr(w))

# small float ops with sizes out of range
x = rng.standard_normal(4096).astype(np.float32)
out = np.zeros(4096, np.float32)
call(lib.ms_rms_norm, ptr(x), ptr(x), 4, 0, 1e-6, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_rms_norm, ptr(x), ptr(x), -1, 16, 1e-6, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_rms_norm, ptr(x), None, 1, 16, 1e-6, ptr(out), want=native.BAD_PTR)
call(lib.ms_rms_norm, ptr(x), ptr(x), 2, 16, float("nan"), ptr(out))
call(lib.ms_rms_norm_rows, ptr(x), ptr(x), 4, 0, 1e-6, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_rms_norm_rows, ptr(x), ptr(x), -1, 16, 1e-6, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_rms_norm_rows, ptr(x), None, 1, 16, 1e-6, ptr(out), want=native.BAD_PTR)
call(lib.ms_rms_norm_rows, None, None, 0, 16, 1e-6, None)
call(lib.ms_rms_norm_rows, ptr(x), ptr(x), 256, 16, 1e-6, ptr(out))  # 256 rows of 16 floats: one task
rows = np.array([0, 3, 1, 1 << 40, -1], np.int64)
for n_rows, first in ((4, 3), (4, 4), (4, 0)):  # rows out of range (1 << 40, -1), then none read past n_out
    call(lib.ms_add_weighted_rows, ptr(out), n_rows, 16, ptr(rows[first:]), ptr(x), ptr(x), 2,
         want=native.BAD_SHAPE if first else None)
call(lib.ms_add_weighted_rows, ptr(out), 4, 0, ptr(rows), ptr(x), ptr(x), 2, want=native.BAD_SHAPE)
call(lib.ms_add_weighted_rows, ptr(out), 4, 16, ptr(rows), ptr(x), ptr(x), -1, want=native.BAD_SHAPE)
call(lib.ms_add_weighted_rows, ptr(out), 4, 16, None, ptr(x), ptr(x), 2, want=native.BAD_PTR)
# the delta rule: 70 tokens (a chunk and a part), 2 value heads on 1 key head, arrays of exactly their size
dq, dv_ = rng.standard_normal(70 * 2 * 8).astype(np.float32), rng.standard_normal(70 * 2 * 16).astype(np.float32)
dg, dS = -rng.random(70 * 2).astype(np.float32), np.zeros(2 * 8 * 16, np.float32)
dout = np.zeros(70 * 2 * 16, np.float32)
call(lib.ms_delta_rule, 70, 1, 2, 8, 16, ptr(dq), ptr(dq[8:]), 16, ptr(dv_), ptr(dg), ptr(dg), ptr(dS), ptr(dout))
for T_, hk, hv, dk_, dv2, ld in ((70, 1, 2, 12, 16, 24), (70, 2, 3, 8, 16, 16), (70, 1, 2, 8, 16, 7),
                                 (-1, 1, 2, 8, 16, 16), (70, 0, 2, 8, 16, 16), (70, 1, 2, 8, 0, 16),
                                 (1 << 40, 1, 2, 8, 16, 16)):
    call(lib.ms_delta_rule, T_, hk, hv, dk_, dv2, ptr(dq), ptr(dq), ld, ptr(dv_), ptr(dg), ptr(dg), ptr(dS),
         ptr(dout), want=native.BAD_SHAPE)
call(lib.ms_delta_rule, 70, 1, 2, 8, 16, ptr(dq), None, 16, ptr(dv_), ptr(dg), ptr(dg), ptr(dS), ptr(dout),
     want=native.BAD_PTR)
call(lib.ms_causal_conv, ptr(dout), 70, 16, 4, ptr(dq), ptr(dv_))  # buf [73][16] in dout, out [70][16] in dv_
for T_, c_, k_ in ((-1, 16, 4), (70, 0, 4), (70, 16, 0), (70, 16, 65)):
    call(lib.ms_causal_conv, ptr(dout), T_, c_, k_, ptr(dq), ptr(dv_), want=native.BAD_SHAPE)
call(lib.ms_causal_conv, None, 70, 16, 4, ptr(dq), ptr(dv_), want=native.BAD_PTR)
call(lib.ms_gemv_f32, ptr(x), 0, 16, ptr(x), 1, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_gemv_f32, ptr(x), 16, 16, ptr(x), -1, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_rope_neox, ptr(out), 1, 2, 16, 18, ptr(x), ptr(x), want=native.BAD_SHAPE)
call(lib.ms_rope_neox, ptr(out), 1, 2, 16, 7, ptr(x), ptr(x), want=native.BAD_SHAPE)
call(lib.ms_rope_neox, ptr(out), 1, 2, 16, 16, None, ptr(x), want=native.BAD_PTR)
for s, h, hkv, d in ((1, 4, 3, 16), (0, 4, 2, 16), (1, 4, 0, 16), (1, 4, 2, 0), (1 << 31, 1 << 20, 1 << 20, 64)):
    call(lib.ms_attn_decode, ptr(x), ptr(x), ptr(x), s, h, hkv, d, 0, 1.0, ptr(out), want=native.BAD_SHAPE)
kv = np.full(8 * 2 * 16, np.nan, np.float32)
call(lib.ms_attn_decode, ptr(x), ptr(kv), ptr(kv), 8, 4, 2, 16, 0, 1.0, ptr(out))
call(lib.ms_attn_decode, ptr(x), ptr(kv), ptr(kv), 8, 4, 2, 24, 1, 1.0, ptr(out))
call(lib.ms_attn_decode, ptr(x), ptr(kv), ptr(kv), 8, 4, 2, 24, 2, 1.0, ptr(out))
call(lib.ms_attn_decode, ptr(x), ptr(kv), ptr(kv), 8, 4, 2, 24, 3, 1.0, ptr(out), want=native.BAD_TYPE)
# a prompt's attention: 3 queries at positions 5..7 over 8 keys (4 heads on 2), exactly sized arrays
pq, pout = rng.standard_normal(3 * 4 * 16).astype(np.float32), np.zeros(3 * 4 * 16, np.float32)
pkv = np.full(8 * 2 * 16, np.nan, np.float32)
call(lib.ms_attn_prefill, ptr(pq), ptr(pkv), ptr(pkv), 3, 8, 4, 2, 16, 5, 0, 1.0, ptr(pout))
call(lib.ms_attn_prefill, ptr(pq), ptr(pkv), ptr(pkv), 3, 8, 4, 2, 16, 5, 1, 1.0, ptr(pout))
call(lib.ms_attn_prefill, ptr(pq), ptr(pkv), ptr(pkv), 3, 8, 4, 2, 16, 5, 2, 1.0, ptr(pout))
call(lib.ms_attn_prefill, ptr(pq), ptr(pkv), ptr(pkv), 3, 8, 4, 2, 16, 5, -1, 1.0, ptr(pout), want=native.BAD_TYPE)
for t_, s, h, hkv, d, p0 in ((3, 8, 4, 3, 16, 5), (3, 8, 4, 2, 12, 5), (3, 8, 4, 2, 16, 6), (3, 8, 4, 2, 16, -1),
                             (-1, 8, 4, 2, 16, 5), (3, 0, 4, 2, 16, 0), (3, 8, 4, 2, 520, 5),
                             (1 << 40, 1 << 41, 4, 2, 16, 0)):
    call(lib.ms_attn_prefill, ptr(pq), ptr(pkv), ptr(pkv), t_, s, h, hkv, d, p0, 0, 1.0, ptr(pout),
         want=native.BAD_SHAPE)
call(lib.ms_attn_prefill, ptr(pq), None, ptr(pkv), 3, 8, 4, 2, 16, 5, 0, 1.0, ptr(pout), want=native.BAD_PTR)
call(lib.ms_gemv_bf16, ptr(x), 0, 16, ptr(x), 1, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_gemv_bf16, ptr(x), 16, 16, ptr(x), -1, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_gemv_bf16, None, 16, 16, ptr(x), 1, ptr(out), want=native.BAD_PTR)
call(lib.ms_gemv_bf16, ptr(x), 8, 17, ptr(x), 2, ptr(out))  # a row length off the vector width
# MLA decode: (s, h, L, R, nope, vd) out of range, a null pointer, a NaN cache, odd sizes in bf16
for s, h, L, R, nope, vd in ((0, 2, 16, 8, 8, 8), (1, 0, 16, 8, 8, 8), (1, 2, 16, -8, 8, 8),
                             (1 << 31, 1 << 20, 1 << 20, 8, 8, 8)):  # fmt: skip
    call(lib.ms_mla_decode, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(x), ptr(x), 0, None, max(s, 1), s, h, L, R,
         nope, vd, 1.0,
         ptr(out), want=native.BAD_SHAPE)  # fmt: skip
call(lib.ms_mla_decode, ptr(x), None, ptr(x), ptr(x), 0, ptr(x), ptr(x), 0, None, 4, 4, 2, 16, 8, 8, 8, 1.0, ptr(out),
     want=native.BAD_PTR)  # fmt: skip
call(lib.ms_mla_decode, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(kv), ptr(kv), 0, None, 4, 4, 5, 16, 8, 8, 8, 1.0,
     ptr(out))  # fmt: skip
call(lib.ms_mla_decode, ptr(x), ptr(x), ptr(x), ptr(x), 1, ptr(x), ptr(x), 1, None, 9, 9, 5, 20, 6, 18, 17, 1.0,
     ptr(out))  # fmt: skip
# latent in, latent out (the caller holds the up-projections at their file's bits): both null or neither, and
# the query's and output's widths are then the latent's
call(lib.ms_mla_decode, ptr(x), ptr(x), None, None, 0, ptr(x), ptr(x), 0, None, 4, 4, 2, 16, 8, 16, 16, 1.0, ptr(out))
call(lib.ms_mla_decode, ptr(x), ptr(x), None, None, 0, ptr(x), ptr(x), 0, None, 4, 4, 2, 16, 8, 8, 16, 1.0, ptr(out),
     want=native.BAD_SHAPE)  # fmt: skip
call(lib.ms_mla_decode, ptr(x), ptr(x), ptr(x), None, 0, ptr(x), ptr(x), 0, None, 4, 4, 2, 16, 8, 8, 8, 1.0, ptr(out),
     want=native.BAD_PTR)  # fmt: skip
# the rows an indexer chose: each must lie in the cache (4 rows here), else a refusal before any read
for bad in (4, -1):
    picked = np.array([0, 2, bad], np.int64)
    call(lib.ms_mla_decode, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(x), ptr(x), 0, ptr(picked), 4, 3, 2, 16, 8, 8, 8,
         1.0, ptr(out), want=native.BAD_SHAPE)  # fmt: skip
picked = np.array([3, 0, 2], np.int64)
call(lib.ms_mla_decode, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(x), ptr(x), 0, ptr(picked), 4, 3, 2, 16, 8, 8, 8, 1.0,
     ptr(out))  # fmt: skip
call(lib.ms_mla_decode, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(x), ptr(x), 0, None, 4, 5, 2, 16, 8, 8, 8, 1.0,
     ptr(out), want=native.BAD_SHAPE)  # fmt: skip
# a prompt's sparse attention: each query's count within 1..k and its rows in the cache (4 rows), else refused
sp_rows, sp_ok = np.array([0, 2, 1, 3], np.int64), np.array([2, 1], np.int64)
call(lib.ms_mla_sparse, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(sp_rows), ptr(sp_ok), 4, 2, 2, 2, 16, 8, 1.0, ptr(out))
for bad_rows, bad_counts in (([0, 4, 1, 3], [2, 1]), ([0, 2, -1, 3], [2, 1]), ([0, 2, 1, 3], [3, 1]),
                             ([0, 2, 1, 3], [2, 0])):  # fmt: skip
    r_, c_ = np.array(bad_rows, np.int64), np.array(bad_counts, np.int64)
    call(lib.ms_mla_sparse, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(r_), ptr(c_), 4, 2, 2, 2, 16, 8, 1.0, ptr(out),
         want=native.BAD_SHAPE)  # fmt: skip
call(lib.ms_mla_sparse, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(sp_rows), None, 4, 2, 2, 2, 16, 8, 1.0, ptr(out),
     want=native.BAD_PTR)  # fmt: skip
call(lib.ms_mla_sparse, ptr(x), ptr(x), ptr(x), ptr(x), 0, ptr(sp_rows), ptr(sp_ok), 4, 1 << 31, 1 << 20, 2, 16, 8,
     1.0, ptr(out), want=native.BAD_SHAPE)  # fmt: skip
# the indexer's top-k: k within 1..n
for n_, k_ in ((0, 1), (8, 0), (8, 9), (-1, 1)):
    call(lib.ms_topk_positions, ptr(x), n_, k_, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_topk_positions, None, 8, 2, ptr(out), want=native.BAD_PTR)
# the indexer's scores: (heads, dim, keys) out of range, a null pointer, odd sizes in bf16
for h, d, s in ((0, 16, 4), (4, 0, 4), (4, 16, 0), (1 << 21, 1 << 20, 4), (4, 1 << 20, 1 << 21)):
    call(lib.ms_index_scores, ptr(x), ptr(x), h, d, ptr(x), 0, s, 1.0, ptr(out), want=native.BAD_SHAPE)
call(lib.ms_index_scores, ptr(x), None, 4, 16, ptr(x), 0, 8, 1.0, ptr(out), want=native.BAD_PTR)
call(lib.ms_index_scores, ptr(x), ptr(x), 4, 16, ptr(x), 7, 8, 1.0, ptr(out), want=native.BAD_TYPE)
call(lib.ms_index_scores, ptr(x), ptr(x), 5, 18, ptr(x), 1, 9, 1.0, ptr(out))
for m, k in ((-1, 256), (1, 0), (1 << 31, 1 << 31)):
    call(lib.ms_qmm_scratch_bytes, m, k, want=native.BAD_SHAPE)
call(lib.ms_moe_scratch_bytes, 1, -256, 256, want=native.BAD_SHAPE)

# every dequant type on garbage bytes, and bad sizes
for t, (block, size) in BLOCKS.items():
    n = 3 * 256
    raw = garbage(t, n)
    f32 = np.zeros(n + 16, np.float32)
    f32[n:] = 7
    bf = np.zeros(n + 16, np.uint16)
    call(lib.ms_dequant, t, ptr(raw), n, ptr(f32), 0)
    call(lib.ms_dequant, t, ptr(raw), n, ptr(bf), 1)
    assert (f32[n:] == 7).all() and (bf[n:] == 0).all()
    call(lib.ms_dequant, t, ptr(raw), 0, ptr(f32), 0, want=native.BAD_SHAPE)
    call(lib.ms_dequant, t, ptr(raw), -n, ptr(f32), 0, want=native.BAD_SHAPE)
    if block > 1:
        call(lib.ms_dequant, t, ptr(raw), n + 1, ptr(f32), 0, want=native.BAD_SHAPE)
    call(lib.ms_dequant, t, None, n, ptr(f32), 0, want=native.BAD_PTR)
call(lib.ms_dequant, 99, ptr(raw), 256, ptr(f32), 0, want=native.BAD_TYPE)

# int4 packing and its expansion
for t, rows in ((2, 64), (12, 64), (2, 32), (12, 32)):
    n, k = 128, 512
    raw = garbage(t, n * k)
    packed, sz, wb = np.zeros(n * k // 2, np.uint8), np.zeros(k // 32 * n * 2, np.uint16), np.zeros(n * k, np.uint16)
    call(lib.ms_pack_int4, t, ptr(raw), n, k, ptr(packed), ptr(sz), rows)
    call(lib.ms_int4_to_bf16, ptr(packed), ptr(sz), n, k, 0, n, ptr(wb), rows)
    for nn, kk in ((0, k), (-64, k), (n, 0), (n, -32), (65, k)):
        call(lib.ms_pack_int4, t, ptr(raw), nn, kk, ptr(packed), ptr(sz), rows, want=native.BAD_SHAPE)
    for r0, r1 in ((0, n + 64), (-64, 64), (64, 0), (32, 64)):
        call(lib.ms_int4_to_bf16, ptr(packed), ptr(sz), n, k, r0, r1, ptr(wb), rows, want=native.BAD_SHAPE)
    call(lib.ms_pack_int4, t, ptr(raw), n, k, ptr(packed), ptr(sz), 16, want=native.BAD_SHAPE)
    call(lib.ms_int4_to_bf16, ptr(packed), ptr(sz), n, k, 0, n, ptr(wb), 128, want=native.BAD_SHAPE)

# the lane layout: garbage blocks of every type (odd rows, a half group at the end of each row)
if lib.ms_lane_supported():
    for t in LANE:
        n, k = 5, 768
        raw = garbage(t, n * k)
        rb = lib.ms_lane_row_bytes(t, k)
        lane = np.zeros(n * rb + 64, np.uint8)
        lane[n * rb:] = 0xA5
        call(lib.ms_lane_pack, t, ptr(raw), n, k, ptr(lane))
        assert (lane[n * rb:] == 0xA5).all()
        dense = np.zeros(n * k, np.float32)
        call(lib.ms_lane_unpack, t, ptr(lane), n, k, ptr(dense))
        for m in (1, 2, 5):
            xs = rng.standard_normal((m, k)).astype(np.float32)
            xs[0, 3] = np.nan
            if m > 1:
                xs[1, :32] = 1e-44  # subnormal block
            y = np.zeros(m * n + 16, np.float32)
            y[m * n:] = 7
            call(lib.ms_qmm, t, ptr(lane), n, k, ptr(xs), m, k, ptr(y), n)
            assert (y[m * n:] == 7).all()
        for nn, kk, m, ldx, ldy in ((0, k, 1, k, n), (n, 100, 1, k, n), (n, k, -1, k, n), (n, k, 1, k - 1, n),
                                    (n, k, 1, k, n - 1), (n, 1 << 40, 1, 1 << 40, n)):
            call(lib.ms_qmm, t, ptr(lane), nn, kk, ptr(xs), m, ldx, ptr(y), ldy, want=native.BAD_SHAPE)
        call(lib.ms_qmm, t, None, n, k, ptr(xs), 1, k, ptr(y), n, want=native.BAD_PTR)
        # one matrix a head (a row each here), each with its own two input rows
        xg = rng.standard_normal((n, 2, k)).astype(np.float32)
        yg = np.zeros(n * 2 + 16, np.float32)
        yg[n * 2:] = 7
        call(lib.ms_qmm_groups, t, ptr(lane), n, 1, k, ptr(xg), 2, ptr(yg))
        assert (yg[n * 2:] == 7).all()
        for g_, nn, kk, m in ((0, 1, k, 2), (n, 0, k, 2), (n, 1, 100, 2), (n, 1, k, -1), (1 << 20, 1 << 20, k, 1)):
            call(lib.ms_qmm_groups, t, ptr(lane), g_, nn, kk, ptr(xg), m, ptr(yg), want=native.BAD_SHAPE)
        call(lib.ms_qmm_groups, t, None, n, 1, k, ptr(xg), 2, ptr(yg), want=native.BAD_PTR)
        call(lib.ms_lane_pack, t, ptr(raw), -1, k, ptr(lane), want=native.BAD_SHAPE)
        call(lib.ms_lane_unpack, t, ptr(lane), n, k, None, want=native.BAD_PTR)
    call(lib.ms_qmm, 16, ptr(lane), 5, 256, ptr(xs), 1, 256, ptr(y), 5, want=native.BAD_TYPE)  # IQ2_XXS: no lane form

    # rows of a multiple of 32 only: a last group of 1..15 lanes, read masked; rows cut short of a block refused
    for t in PER32:
        for n, k in ((3, 32), (5, 352), (2, 1408), (1, 2880)):
            raw = garbage(t, n * k)
            rb = lib.ms_lane_row_bytes(t, k)
            lane = np.zeros(n * rb + 64, np.uint8)
            lane[n * rb:] = 0xA5
            call(lib.ms_lane_pack, t, ptr(raw), n, k, ptr(lane))
            assert (lane[n * rb:] == 0xA5).all()
            dense = np.zeros(n * k + 16, np.float32)
            dense[n * k:] = 7
            call(lib.ms_lane_unpack, t, ptr(lane), n, k, ptr(dense))
            assert (dense[n * k:] == 7).all()
            for m in (1, 2, 5):
                xs = rng.standard_normal((m, k)).astype(np.float32)
                xs[-1, -1] = np.nan
                y = np.zeros(m * n + 16, np.float32)
                y[m * n:] = 7
                call(lib.ms_qmm, t, ptr(lane), n, k, ptr(xs), m, k, ptr(y), n)
                assert (y[m * n:] == 7).all()
        for k in (16, 48, 1400, 0):
            call(lib.ms_lane_row_bytes, t, k, want=native.BAD_SHAPE)
            call(lib.ms_qmm, t, ptr(lane), 1, k, ptr(xs), 1, max(k, 1), ptr(y), 1, want=native.BAD_SHAPE)
        # SwiGLU experts of an odd width (f = 352: a group of 11 lanes), Q4_K gate/up with this down
        h, f = 512, 352
        raw_gu, raw_dn = garbage(12, 2 * f * h), garbage(t, h * f)
        gu = np.zeros(2 * f * lib.ms_lane_row_bytes(12, h), np.uint8)
        dn = np.zeros(h * lib.ms_lane_row_bytes(t, f) + 64, np.uint8)
        call(lib.ms_lane_pack, 12, ptr(raw_gu), 2 * f, h, ptr(gu))
        call(lib.ms_lane_pack, t, ptr(raw_dn), h, f, ptr(dn))
        xs = rng.standard_normal((2, h)).astype(np.float32)
        out = np.zeros(2 * h + 16, np.float32)
        out[2 * h:] = 7
        one = lambda n, v: (ctypes.c_int64 * 1)(v) if n == "m" else (ctypes.c_void_p * 1)(v)  # noqa: E731
        call(lib.ms_moe_ffn, 1, (ctypes.c_int * 1)(12), one("p", ptr(gu)), (ctypes.c_int * 1)(t), one("p", ptr(dn)),
             h, f, one("p", ptr(xs)), one("m", 2), one("p", ptr(out)))
        assert (out[2 * h:] == 7).all()
        call(lib.ms_moe_ffn, 1, (ctypes.c_int * 1)(12), one("p", ptr(gu)), (ctypes.c_int * 1)(12), one("p", ptr(dn)),
             h, f, one("p", ptr(xs)), one("m", 2), one("p", ptr(out)), want=native.BAD_SHAPE)  # Q4_K rows of 352
        # GPT-OSS's clamped form: biases of exactly f, f and h floats (guarded), the same odd width
        bg, bu, bd = (np.zeros(n + 16, np.float32) for n in (f, f, h))
        for b, n in ((bg, f), (bu, f), (bd, h)):
            b[:n] = rng.standard_normal(n)
            b[n:] = 7
        biases = [one("p", ptr(b)) for b in (bg, bu, bd)]
        moe = [1, (ctypes.c_int * 1)(12), one("p", ptr(gu)), (ctypes.c_int * 1)(t), one("p", ptr(dn)), h, f,
               one("p", ptr(xs)), one("m", 2), one("p", ptr(out))]
        call(lib.ms_moe_ffn_clamped, *moe, *biases, 1.702, 7.0, 1.0)
        assert (out[2 * h:] == 7).all() and all((b[n:] == 7).all() for b, n in ((bg, f), (bu, f), (bd, h)))
        call(lib.ms_moe_ffn_clamped, *moe[:3], (ctypes.c_int * 1)(12), *moe[4:], *biases, 1.702, 7.0, 1.0,
             want=native.BAD_SHAPE)  # Q4_K rows of 352
        call(lib.ms_moe_ffn_clamped, *moe, biases[0], one("p", None), biases[2], 1.702, 7.0, 1.0, want=native.BAD_PTR)
        call(lib.ms_moe_ffn_clamped, *moe, *biases[:2], None, 1.702, 7.0, 1.0, want=native.BAD_PTR)
        call(lib.ms_moe_ffn_clamped, *moe, *biases, 1.702, -1.0, 1.0, want=native.BAD_SHAPE)
        call(lib.ms_moe_ffn_clamped, *moe, *biases, float("nan"), 7.0, 1.0, want=native.BAD_SHAPE)
        call(lib.ms_moe_ffn_clamped, 0, *moe[1:], *biases, 1.702, 7.0, 1.0, want=native.BAD_SHAPE)
        call(lib.ms_moe_ffn_clamped, *moe, *biases, 1.702, 7.0, float("inf"), want=native.BAD_SHAPE)

    # several segments at once, and bad counts
    segs = [(t, 3, 512, garbage(t, 3 * 512)) for t in LANE]
    dsts = [np.zeros(3 * lib.ms_lane_row_bytes(t, 512), np.uint8) for t, *_ in segs]
    arrays = [np.array([s[0] for s in segs], np.int32), np.array([ptr(s[3]) for s in segs], np.uint64),
              np.array([s[1] for s in segs], np.int64), np.array([s[2] for s in segs], np.int64),
              np.array([ptr(d) for d in dsts], np.uint64)]
    call(lib.ms_lane_pack_many, len(segs), *map(ptr, arrays))
    call(lib.ms_lane_pack_many, 0, *map(ptr, arrays))
    call(lib.ms_lane_pack_many, -1, *map(ptr, arrays), want=native.BAD_SHAPE)
    call(lib.ms_lane_pack_many, 2, None, *map(ptr, arrays[1:]), want=native.BAD_PTR)
    arrays[2][1] = 0
    call(lib.ms_lane_pack_many, len(segs), *map(ptr, arrays), want=native.BAD_SHAPE)

    # SwiGLU experts from garbage blocks; NaN inputs; bad counts
    h, f = 256, 512
    gu = [np.zeros(2 * f * lib.ms_lane_row_bytes(t, h), np.uint8) for t in LANE]
    dn = [np.zeros(h * lib.ms_lane_row_bytes(t, f), np.uint8) for t in LANE]
    for t, a, b in zip(LANE, gu, dn):
        raw_gu, raw_dn = garbage(t, 2 * f * h), garbage(t, h * f)  # held: a bare address keeps nothing alive
        lib.ms_lane_pack(t, ptr(raw_gu), 2 * f, h, ptr(a))
        lib.ms_lane_pack(t, ptr(raw_dn), h, f, ptr(b))
    ne = len(LANE)
    xs = rng.standard_normal((3, h)).astype(np.float32)
    xs[2, 7] = np.inf
    outs = [np.zeros(3 * h, np.float32) for _ in LANE]
    c_int, c_vp, c_i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
    types = (c_int * ne)(*LANE)
    args = [types, (c_vp * ne)(*map(ptr, gu)), types, (c_vp * ne)(*map(ptr, dn)), h, f,
            (c_vp * ne)(*[ptr(xs)] * ne), (c_i64 * ne)(3, 0, 1, 2, 3), (c_vp * ne)(*map(ptr, outs))]
    call(lib.ms_moe_ffn, ne, *args)
    call(lib.ms_moe_ffn, 0, *args, want=native.BAD_SHAPE)
    call(lib.ms_moe_ffn, 2000, *args, want=native.BAD_SHAPE)
    call(lib.ms_moe_ffn, ne, *args[:4], 100, *args[5:], want=native.BAD_SHAPE)
    call(lib.ms_moe_ffn, ne, *args[:7], (c_i64 * ne)(1, -1, 0, 0, 0), args[8], want=native.BAD_SHAPE)
    call(lib.ms_moe_ffn, ne, *args[:6], (c_vp * ne)(None, *[ptr(xs)] * (ne - 1)), *args[7:], want=native.BAD_PTR)

    # a whole attention block from garbage weights, then with inconsistent head counts
    hidden, heads, kvh, hd, ctx = 256, 2, 1, 128, 4
    qkv_rows = (heads + 2 * kvh) * hd
    qkv = np.zeros(qkv_rows * lib.ms_lane_row_bytes(12, hidden), np.uint8)
    o = np.zeros(hidden * lib.ms_lane_row_bytes(12, heads * hd), np.uint8)
    raw_qkv, raw_o = garbage(12, qkv_rows * hidden), garbage(12, hidden * heads * hd)
    lib.ms_lane_pack(12, ptr(raw_qkv), qkv_rows, hidden, ptr(qkv))
    lib.ms_lane_pack(12, ptr(raw_o), hidden, heads * hd, ptr(o))
    xv, nw = rng.standard_normal(hidden).astype(np.float32), np.ones(hidden, np.float32)
    qn, cs = np.ones(hd, np.float32), np.ones(hd // 2 * ctx, np.float32)
    kc, vc = np.zeros(ctx * kvh * hd, np.float32), np.zeros(ctx * kvh * hd, np.float32)
    ov = np.zeros(hidden, np.float32)

    def block(heads, kvh, hd, rot, pos, want=None):
        call(lib.ms_attn_block_decode, ptr(xv), ptr(nw), hidden, 1e-6, 12, ptr(qkv), ptr(qn), ptr(qn), heads, kvh,
             hd, ptr(cs), ptr(cs), rot, ptr(kc), ptr(vc), 0, pos, 12, ptr(o), ptr(ov), want=want)

    block(heads, kvh, hd, hd, 1)
    block(heads, 0, hd, hd, 1, want=native.BAD_SHAPE)
    block(3, 2, hd, hd, 1, want=native.BAD_SHAPE)
    block(heads, kvh, hd, hd + 2, 1, want=native.BAD_SHAPE)
    block(heads, kvh, hd, hd, -1, want=native.BAD_SHAPE)
    block(heads, kvh, 0, 0, 1, want=native.BAD_SHAPE)
print("HOSTILE-OK", refused, done)
"""


def _sanitizer_runtime(cc: str) -> str | None:
    try:
        out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A build of the kernels with ASan and UBSan (CPU-tuned, so the VNNI kernels are the ones checked), and
    the environment that runs Python against it."""
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    asan = _sanitizer_runtime(cc)
    if asan is None:
        pytest.skip(f"{cc} has no libasan.so (install the compiler's sanitizer runtime)")
    out = tmp_path_factory.mktemp("asan")
    base = tuple(f for f in native.BASE_FLAGS if not f.startswith("-O"))
    try:
        path = native.build_library((*base, "-march=native", *SANITIZE), out, cc)
    except RuntimeError:
        path = native.build_library((*base, *SANITIZE), out, cc)
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=asan,
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return path, env


def _run(script: str, lib_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, str(lib_path)], env=env, capture_output=True, text=True, timeout=120
    )


def _reports(proc: subprocess.CompletedProcess) -> bool:
    return "AddressSanitizer" in proc.stderr or "runtime error:" in proc.stderr


@pytest.mark.slow
def test_hostile_calls_under_sanitizers(sanitized):
    path, env = sanitized
    proc = _run(HOSTILE, path, env)
    assert not _reports(proc), proc.stderr[-6000:]
    assert proc.returncode == 0 and "HOSTILE-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    refused, done = map(int, proc.stdout.split("HOSTILE-OK")[1].split())
    # the lane layout's calls run only where its kernels do (AVX-512 VNNI)
    assert refused > 60 and done > (40 if native.lane_ok() else 30)


@pytest.mark.slow
def test_the_sanitizer_catches_an_overflow(sanitized):
    """The harness is live: a buffer one row short, passed straight to the C packer, is reported."""
    path, env = sanitized
    script = (
        "import sys, numpy as np\n"
        "from moestream.compute import native\n"
        "lib = native.load_library(sys.argv[1])\n"
        "raw = np.zeros(4 * 2048 // 32 * 34, np.uint8)\n"
        "dst = np.zeros(3 * lib.ms_lane_row_bytes(8, 2048), np.uint8)\n"
        "lib.ms_lane_pack(8, raw.ctypes.data, 4, 2048, dst.ctypes.data)\n"
        "print('NOT-CAUGHT')\n"
    )
    proc = _run(script, path, env)
    assert proc.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------
# the Python side (the normal build, and the torch path without it)


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "native":
        if native.lib() is None:
            pytest.skip("needs the native library")
    else:
        monkeypatch.setattr(native, "lib", lambda extra_flags=(): None)
    return request.param


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_router_output_names_the_layer(path, bad):
    logits = torch.randn(2, 16)
    logits[1, 5] = bad
    with pytest.raises(ModelFileError, match=r"^layer 7: the router's output is not finite \(NaN/inf\); the model"):
        route_topk(logits, 4, True, layer=7)
    with pytest.raises(ModelFileError, match="^the router's output is not finite"):
        route_topk(torch.full((1, 16), bad), 4, False)


def test_router_agrees_on_both_paths(monkeypatch):
    logits = torch.randn(3, 64)
    got = route_topk(logits, 8, True)
    monkeypatch.setattr(native, "lib", lambda extra_flags=(): None)
    want = route_topk(logits, 8, True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])


def test_weighted_rows_agree_on_both_paths(monkeypatch):
    """The native add of an expert's weighted rows gives index_add_'s bits, expert after expert."""
    gen = torch.Generator().manual_seed(0)
    experts = [
        (torch.randperm(40, generator=gen)[:n], torch.randn(n, 96, generator=gen), torch.rand(n, 1, generator=gen))
        for n in (7, 40, 1, 13)
    ]
    got = torch.randn(40, 96, generator=gen)
    want = got.clone()
    for rows, y, w in experts:
        add_weighted_rows(got, rows, y, w)
    monkeypatch.setattr(native, "lib", lambda extra_flags=(): None)
    for rows, y, w in experts:
        add_weighted_rows(want, rows, y, w)
    assert torch.equal(got, want)


def test_router_refuses_more_experts_than_it_has(path):
    with pytest.raises(ModelFileError, match="layer 2: 17 experts per token of 16"):
        route_topk(torch.randn(1, 16), 17, True, layer=2)
    with pytest.raises(ModelFileError, match="0 experts per token"):
        route_topk(torch.randn(1, 16), 0, True)


@pytest.mark.parametrize("length", [0, 15, 17])
def test_norm_weight_of_the_wrong_length(path, length):
    with pytest.raises(ModelFileError, match=rf"norm weight of shape \({length},\) for rows of 16 values"):
        rms_norm(torch.randn(2, 16), torch.ones(length), 1e-6)


@needs_native
def test_every_refusal_is_a_compute_error_naming_the_kernel():
    lib = native.lib()
    x = np.zeros(64, np.float32)
    with pytest.raises(ComputeError, match=r"ms_rms_norm\(\*, \*, 1, 0, .*sizes or counts") as err:
        lib.ms_rms_norm(x.ctypes.data, x.ctypes.data, 1, 0, 1e-6, x.ctypes.data)
    assert err.value.code == native.BAD_SHAPE
    with pytest.raises(ComputeError, match="ms_route_topk"):
        lib.ms_route_topk(x.ctypes.data, 1, 16, 17, 1, x.ctypes.data, x.ctypes.data)
    with pytest.raises(ComputeError, match="ms_attn_decode"):
        lib.ms_attn_decode(x.ctypes.data, x.ctypes.data, x.ctypes.data, 1, 3, 2, 16, 0, 1.0, x.ctypes.data)
    with pytest.raises(ComputeError, match="ms_rope_neox"):
        lib.ms_rope_neox(x.ctypes.data, 1, 1, 16, 17, x.ctypes.data, x.ctypes.data)
    with pytest.raises(ComputeError, match="ms_gemv_f32"):
        lib.ms_gemv_f32(ctypes.c_void_p(0), 4, 16, x.ctypes.data, 1, x.ctypes.data)


@pytest.mark.skipif(not native.lane_ok(), reason="needs AVX-512 VNNI and the native library")
def test_lane_matmul_checks_its_tensors():
    rng = np.random.default_rng(1)
    lin = linear.from_gguf(quants.random_gguf(T.Q4_K, 64 * 512, rng), T.Q4_K, 64, 512, False)
    with pytest.raises(ComputeError, match=r"lane matmul of \(64, 512\) got an input torch.float32 \(1, 256\)"):
        lin.mm(torch.randn(1, 256))
    with pytest.raises(ComputeError, match="torch.bfloat16"):
        lin.mm(torch.randn(1, 512, dtype=torch.bfloat16))
    # a NaN activation gives NaN outputs (for the router check to report), never garbage from int overflow
    x = torch.randn(2, 512)
    x[0, 100] = float("nan")
    y = lin.mm(x)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()


FUZZ_UNDER_ASAN = r"""
import contextlib, io, sys
from moestream.cli.main import main
from moestream.compute import native
print("LIB", native.lib()._name)
codes = []
for path in sys.argv[1:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(["run", "-m", path, "-p", "hi", "-n", "2", "--threads", "1"])
        except SystemExit as exc:
            rc = exc.code
    codes.append(rc)
    if "Traceback" in err.getvalue():
        print("TRACEBACK", path, err.getvalue()[-2000:])
print("FUZZ-OK", " ".join(map(str, codes)))
"""


@pytest.mark.slow
def test_fuzz_corpus_under_sanitizers(sanitized, tmp_path):
    """The whole engine over corrupted model files, on the sanitized kernels: damaged weights, tables and
    metadata reach every kernel a run uses; no out-of-bounds access, no undefined behaviour, no traceback."""
    lib_path, env = sanitized
    seeds = load_seeds(write_seeds(str(tmp_path / "seeds")))
    paths = []
    for i, family in enumerate(["data"] * 12 + ["tensor-table"] * 6 + ["metadata"] * 6):
        case = make_case(seeds, 3, i, family)
        if not case.special:
            paths.append(materialize(case, str(tmp_path / f"case{i}.gguf")))
    proc = subprocess.run(
        [sys.executable, "-c", FUZZ_UNDER_ASAN, *paths],
        env=env | {"MOESTREAM_NATIVE_LIB": str(lib_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert not _reports(proc), proc.stderr[-6000:]
    assert "TRACEBACK" not in proc.stdout, proc.stdout[-4000:]
    assert proc.returncode == 0 and "FUZZ-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"LIB {lib_path}" in proc.stdout  # the engine really ran on the sanitized build
    codes = proc.stdout.split("FUZZ-OK")[1].split()
    assert len(codes) == len(paths) and set(codes) <= {"0", "2"}, codes
    assert "0" in codes  # some damaged files still run: their kernels really were exercised
