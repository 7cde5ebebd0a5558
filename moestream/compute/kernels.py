"""Typed entry points of the native kernels that model code calls: tensors in, tensors out. The pointers,
counts and flags the C functions take are marshalled here, so model and streaming code never touch ctypes or
addresses. Each function assumes what its caller checked (`available()` and the dtypes and layouts its
docstring names); the C side checks sizes again and refuses with ComputeError.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from moestream.compute import native
from moestream.errors import ComputeError


def available() -> bool:
    return native.lib() is not None


# the C side's element types of a KV cache (and of MLA's up-projections): MS_KV_F32, MS_KV_BF16, MS_KV_F16
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _kv_type(t: torch.Tensor) -> int:
    return KV_TYPES[t.dtype]


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of float32 x with a float32 weight (each row's bits whatever the rows)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    native.lib().ms_rms_norm_rows(x.data_ptr(), weight.contiguous().data_ptr(), x.numel() // dim, dim, eps,
                                  out.data_ptr())  # fmt: skip
    return out


def add_weighted_rows(out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
    """out[rows[i]] += y[i] * w[i] in order, all float32, out contiguous [N, h]."""
    rows, y, w = rows.to(torch.int64).contiguous(), y.contiguous(), w.contiguous()
    native.lib().ms_add_weighted_rows(out.data_ptr(), out.shape[0], out.shape[1], rows.data_ptr(), y.data_ptr(),
                                      w.data_ptr(), y.shape[0])  # fmt: skip


def route_topk(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k of float32 logits [T, E]: (weights, ids) [T, k]; ComputeError(NOT_FINITE) on a NaN/inf."""
    logits = logits.contiguous()
    ids = torch.empty(logits.shape[0], k, dtype=torch.int64)
    weights = torch.empty(logits.shape[0], k)
    native.lib().ms_route_topk(logits.data_ptr(), logits.shape[0], logits.shape[1], k, int(norm), ids.data_ptr(),
                               weights.data_ptr())  # fmt: skip
    return weights, ids


def gemv_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T for float32 x and a contiguous float32 w [N, K], a row at a time."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    native.lib().ms_gemv_f32(w.data_ptr(), w.shape[0], w.shape[1], x.data_ptr(), x.shape[0], y.data_ptr())
    return y


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """x float32 [T, heads, head_dim] rotated (halves) by the contiguous float32 tables' rows [T, 1, rot/2]."""
    y = x.contiguous().clone()
    native.lib().ms_rope_neox(y.data_ptr(), y.shape[0], y.shape[1], y.shape[2], rot_dim, cos.data_ptr(),
                              sin.data_ptr())  # fmt: skip
    return y


def attn_decode(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor | None = None
) -> torch.Tensor | None:
    """One query [1, H, D] (float32) over contiguous keys/values [S, Hkv, D] (any KV_TYPES); sinks: a float32
    logit per query head [H] that joins each softmax's denominator (GPT-OSS). None where the kernel declines
    the shape."""
    q1 = q.contiguous()
    out = torch.empty_like(q1)
    S, H, D = keys.shape[0], q.shape[1], q.shape[2]
    sink = None if sinks is None else sinks.float().contiguous()
    sink_ptr = None if sink is None else sink.data_ptr()
    rc = native.lib().ms_attn_decode_sinks(q1.data_ptr(), keys.data_ptr(), values.data_ptr(), S, H, keys.shape[1], D,
                                           _kv_type(keys), 1.0 / math.sqrt(D), sink_ptr, out.data_ptr())  # fmt: skip
    return out if rc == 0 else None


def attn_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
    """Causal flash attention of q [T, H, D] (positions pos..) over keys/values [S, Hkv, D]."""
    q1 = q.contiguous()
    out = torch.empty_like(q1)
    T, H, D = q.shape
    native.lib().ms_attn_prefill(q1.data_ptr(), keys.data_ptr(), values.data_ptr(), T, keys.shape[0], H,
                                 keys.shape[1], D, pos, _kv_type(keys), 1.0 / math.sqrt(D),
                                 out.data_ptr())  # fmt: skip
    return out


def causal_conv(buf: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution of float32 buf [K - 1 + T, C] with a contiguous filter w_t [K, C]."""
    K, C = w_t.shape
    T = buf.shape[0] - K + 1
    buf = buf.contiguous()
    out = torch.empty(T, C)
    native.lib().ms_causal_conv(buf.data_ptr(), T, C, K, w_t.data_ptr(), out.data_ptr())
    return out


def delta_rule(
    qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor, n_k: int
) -> torch.Tensor:
    """The gated delta rule over T tokens (float32; S [Hv, dk, dv] contiguous, updated in place): o [T, Hv, dv]."""
    T, _, dk = qk.shape
    Hv, dv = v.shape[1:]
    qk, v, g, beta = (t.contiguous() for t in (qk, v, g, beta))
    out = torch.empty(T, Hv, dv)
    native.lib().ms_delta_rule(T, n_k, Hv, dk, dv, qk.data_ptr(), qk[:, n_k:].data_ptr(), qk.shape[1] * dk,
                               v.data_ptr(), g.data_ptr(), beta.data_ptr(), S.data_ptr(), out.data_ptr())  # fmt: skip
    return out


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_b: torch.Tensor | None,
    v_b: torch.Tensor | None,
    latents: torch.Tensor,
    keys: torch.Tensor,
    v_head_dim: int,
    kq_scale: float,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query's absorbed latent attention: q_nope [1, H, nope], q_pe [1, H, rope] over the cache's latents
    [S, L] and rotary keys [S, R] (their own dtypes), with the up-projections k_b [H, L, nope], v_b [H, v, L];
    rows: the cache rows attended, in order (None: all S), read in place instead of gathered. k_b and v_b both
    None: q_nope is the absorbed query [1, H, L] and the result the latent output [1, H, L] (the caller holds the
    up-projections at their file's bits)."""
    qn, qp = q_nope.float().contiguous(), q_pe.float().contiguous()
    lat, kpe = latents.contiguous(), keys.contiguous()
    H, nope, rope = qn.shape[1], qn.shape[2], qp.shape[2]
    out = torch.empty(1, H, v_head_dim if k_b is not None else lat.shape[1])
    idx = None if rows is None else rows.to(torch.int64).contiguous()
    n = lat.shape[0] if idx is None else idx.shape[0]
    w_type = _kv_type(k_b) if k_b is not None else KV_TYPES[torch.float32]
    native.lib().ms_mla_decode(qn.data_ptr(), qp.data_ptr(), None if k_b is None else k_b.data_ptr(),
                                    None if v_b is None else v_b.data_ptr(), w_type, lat.data_ptr(), kpe.data_ptr(),
                                    _kv_type(lat), None if idx is None else idx.data_ptr(), lat.shape[0], n, H,
                                    lat.shape[1], rope, nope, out.shape[2], kq_scale, out.data_ptr())  # fmt: skip
    return out


def qmm_groups(weight: torch.Tensor, ggml_type: int, rows: int, x: torch.Tensor) -> torch.Tensor:
    """A lane-form weight of G stacked [n, K] matrices (`rows` = G n; per-head weights), each applied to its own
    inputs: x float32 [G, M, K] -> [G, M, n], y[g] = x[g] @ W_g.T, all groups in one call on the lane pool."""
    G, M, K = x.shape
    if rows % G:
        raise ComputeError(f"grouped products of {rows} rows in {G} groups")
    x = x.float().contiguous()
    y = torch.empty(G, M, rows // G)
    native.lib().ms_qmm_groups(ggml_type, weight.data_ptr(), G, rows // G, K, x.data_ptr(), M, y.data_ptr())
    return y


def mla_sparse(q_lat: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, keys: torch.Tensor,
               rows: torch.Tensor, counts: torch.Tensor, kq_scale: float) -> torch.Tensor:  # fmt: skip
    """Prompt queries, each over its own cache rows: absorbed queries q_lat [T, H, L] and rotary q_pe [T, H, R]
    (float32) attend to latents [S, L] and rotary keys [S, R] (the cache's dtype) at rows[t, :counts[t]];
    returns the latent outputs [T, H, L] (before the value up-projection)."""
    ql, qp = q_lat.float().contiguous(), q_pe.float().contiguous()
    lat, kpe = latents.contiguous(), keys.contiguous()
    idx, n = rows.to(torch.int64).contiguous(), counts.to(torch.int64).contiguous()
    T, H, L = ql.shape
    out = torch.empty(T, H, L)
    native.lib().ms_mla_sparse(ql.data_ptr(), qp.data_ptr(), lat.data_ptr(), kpe.data_ptr(), _kv_type(lat),
                               idx.data_ptr(), n.data_ptr(), lat.shape[0], T, idx.shape[1], H, L, qp.shape[2],
                               kq_scale, out.data_ptr())  # fmt: skip
    return out


def topk_positions(x: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the k largest of float32 x [n], in ascending order (equal values at the cut: the first
    positions); ComputeError(NOT_FINITE) on a NaN."""
    x = x.float().contiguous()
    out = torch.empty(k, dtype=torch.int64)
    native.lib().ms_topk_positions(x.data_ptr(), x.shape[0], k, out.data_ptr())
    return out


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The lightning indexer's scores of one query: float32 [S], sum_h weights[h] relu(scale q[h] . keys[s]) for
    q [heads, D] and weights [heads] (float32) over keys [S, D] in the cache's dtype, the heads summed in order."""
    qf, w, k = q.float().contiguous(), weights.float().contiguous(), keys.contiguous()
    out = torch.empty(k.shape[0])
    native.lib().ms_index_scores(qf.data_ptr(), w.data_ptr(), qf.shape[0], qf.shape[1], k.data_ptr(), _kv_type(k),
                                 k.shape[0], scale, out.data_ptr())  # fmt: skip
    return out


def attn_block_decode_rows(
    x: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    qkv,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    heads: tuple[int, int, int],
    rope_rows: list[tuple[torch.Tensor, torch.Tensor]],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    positions: list[int],
    o,
) -> torch.Tensor:
    """A whole grouped-query attention block (norm, fused q/k/v in the lane form, q/k norms, rotary, attention
    over each row's own cache, output projection) for rows of x [B, hidden], in one call that reads the
    projections once. heads: (query heads, kv heads, head dim); rope_rows: each row's (cos, sin) table rows;
    caches: each row's (keys, values) [ctx, Hkv, D], all of one of KV_TYPES."""
    B = x.shape[0]
    n_heads, n_kv_heads, head_dim = heads
    x = x.contiguous()
    out = torch.empty_like(x)
    ptrs = ctypes.c_void_p * B
    rc = native.lib().ms_attn_block_decode_rows(
        B, x.data_ptr(), norm.data_ptr(), x.shape[1], eps, qkv.ggml_type, qkv.weight.data_ptr(),
        q_norm.data_ptr(), k_norm.data_ptr(), n_heads, n_kv_heads, head_dim,
        ptrs(*(c.data_ptr() for c, _ in rope_rows)), ptrs(*(s.data_ptr() for _, s in rope_rows)),
        2 * (rope_rows[0][0].shape[-1]),
        ptrs(*(kc.data_ptr() for kc, _ in caches)), ptrs(*(vc.data_ptr() for _, vc in caches)),
        _kv_type(caches[0][0]), (ctypes.c_int64 * B)(*positions), o.ggml_type, o.weight.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"ms_attn_block_decode_rows failed ({rc})")
    return out


def lane_pack_many(shapes: list[tuple[int, int, int]], srcs: list[int], dsts: list[int]) -> int:
    """Pack matrices read from disk (ggml type, rows, cols each; at the addresses srcs) into the lane form at
    dsts, in one call spread over the lane pool: 0, or the C side's error code."""
    types = np.array([t for t, _, _ in shapes], np.int32)
    ns = np.array([n for _, n, _ in shapes], np.int64)
    ks = np.array([k for _, _, k in shapes], np.int64)
    src, dst = np.array(srcs, np.uint64), np.array(dsts, np.uint64)
    return native.lib().ms_lane_pack_many(len(shapes), types.ctypes.data, src.ctypes.data, ns.ctypes.data,
                                          ks.ctypes.data, dst.ctypes.data)  # fmt: skip


def fp8_block_decode(
    src: np.ndarray, n: int, k: int, scales: np.ndarray, block: tuple[int, int], bf16: bool
) -> np.ndarray:
    """FP8 e4m3 bytes [n, k] times their float32 block scales [ceil(n/bn), ceil(k/bk)] -> the bytes of a
    bf16 (or float32) [n, k] matrix, by the C library (torch where it is not built)."""
    src = np.ascontiguousarray(src[: n * k])
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    if src.size < n * k or scales.shape != (-(-n // block[0]), -(-k // block[1])):
        raise ValueError(f"fp8 [{n}, {k}]: {src.size} bytes and scales {scales.shape} do not fit blocks {block}")
    out = np.empty(n * k * (2 if bf16 else 4), np.uint8)
    lib = native.lib()
    if lib is not None:
        lib.ms_fp8_block_decode(src.ctypes.data, n, k, scales.ctypes.data, block[0], block[1], out.ctypes.data,
                                int(bf16))  # fmt: skip
        return out
    w = torch.from_numpy(src).view(torch.float8_e4m3fn).float().view(n, k)
    s = torch.from_numpy(scales).repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    w = w * s
    return (w.to(torch.bfloat16).view(torch.int16) if bf16 else w).numpy().view(np.uint8).reshape(-1)


def fp8_pack(src: np.ndarray, n: int, k: int, scales: np.ndarray, rows_per_scale: int) -> np.ndarray:
    """FP8 e4m3 bytes [n, k] and their float32 block scales [ceil(n/rows_per_scale), k/128] -> the FP8 compute
    form's bytes (quants.FP8_B128: per 128 weights of a row, its block's scale then the 128 bytes), by the C
    library (numpy where it is not built). A NaN byte or a non-finite scale raises."""
    src = np.ascontiguousarray(src[: n * k])
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    if src.size < n * k or k % 128 or scales.shape != (-(-n // rows_per_scale), k // 128):
        raise ValueError(f"fp8 [{n}, {k}]: {src.size} bytes and scales {scales.shape} do not fit 128-column blocks")
    out = np.empty(n * k // 128 * 132, np.uint8)
    lib = native.lib()
    if lib is not None:
        lib.ms_fp8_pack(src.ctypes.data, n, k, scales.ctypes.data, rows_per_scale, out.ctypes.data)
        return out
    if ((src & 0x7F) == 0x7F).any() or not np.isfinite(scales).all():
        raise ValueError(f"fp8 [{n}, {k}]: NaN weights or non-finite scales")
    blocks = out.reshape(n, k // 128, 132)
    blocks[:, :, :4] = np.repeat(scales, rows_per_scale, axis=0)[:n, :, None].view(np.uint8)
    blocks[:, :, 4:] = src.reshape(n, k // 128, 128)
    return out


FP8_SCRATCH_BYTES = 8 << 20  # float32 scratch for one slice of a widened FP8 weight


def fp8_mm(weight: torch.Tensor, n: int, k: int, x2: torch.Tensor, gemm_min_rows: int) -> torch.Tensor:
    """float32 x2 [M, K] (contiguous) @ W.T for W [n, k] in the FP8 form (uint8 [n, row bytes]): the native
    kernel below gemm_min_rows rows, else float32 GEMMs over W widened a slice of rows at a time (bounded
    scratch), which amortize the widening over the rows."""
    lib = native.lib()
    if x2.shape[0] < gemm_min_rows:
        y = torch.empty(x2.shape[0], n)
        lib.ms_fp8_mm(weight.data_ptr(), n, k, x2.data_ptr(), x2.shape[0], y.data_ptr())
        return y
    step = max(1, FP8_SCRATCH_BYTES // (4 * k))
    scratch = torch.empty(min(step, n), k)
    parts = []
    for r0 in range(0, n, step):
        w = scratch[: min(n, r0 + step) - r0]
        lib.ms_fp8_unpack(weight[r0:].data_ptr(), w.shape[0], k, w.data_ptr(), 0)
        parts.append(torch.nn.functional.linear(x2, w))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
