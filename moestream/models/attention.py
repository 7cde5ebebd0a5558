"""Attention over a cache's keys and values: a long span a query chunk at a time, the causal mask, torch's
SDPA where the native kernels do not take the shapes, and attention with per-head sinks (GPT-OSS)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from moestream.compute import kernels
from moestream.models.ops import wide_torch


def query_chunks(T: int, chunk: int) -> list[tuple[int, int]]:
    """[a, b) ranges of at most `chunk` of T query positions: a long span's attention runs one at a time, so
    that its buffers (scores, mask, output blocks) are chunk x keys, never T x keys."""
    chunk = max(1, chunk)
    return [(a, min(T, a + chunk)) for a in range(0, T, chunk)]


def by_query_chunks(
    x: torch.Tensor, kv: Any, pos: int, run: Callable[[torch.Tensor, int], torch.Tensor]
) -> torch.Tensor:
    """run(x, pos) for an attention block, a prompt span longer than the cache's query chunk a chunk at a
    time (run(x[a:b], pos + a), projections included; each chunk's keys are written before it attends): the
    span then holds its output and one chunk's q, k, v and attention, not those of every token, which the
    budget's compute_nbytes counts."""
    T = x.shape[0]
    chunk = getattr(kv, "query_chunk", T) or T
    if T <= chunk:
        return run(x, pos)
    out: torch.Tensor | None = None
    for a, b in query_chunks(T, chunk):
        y = run(x[a:b], pos + a)
        if out is None:
            out = torch.empty(T, *y.shape[1:], dtype=y.dtype)
        out[a:b] = y
    assert out is not None
    return out


def causal_mask(T: int, S: int, pos: int) -> torch.Tensor | None:
    """[T, S] True where query pos + t may see key s (none for one query: it sees every key)."""
    if T == 1:
        return None
    return torch.arange(S)[None, :] <= torch.arange(pos, pos + T)[:, None]


def native_decode_ok(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ms_attn_decode takes these: float32 queries over a contiguous cache of one of its types."""
    return (
        kernels.available()
        and q.dtype == torch.float32
        and keys.dtype in kernels.KV_TYPES
        and keys.dtype == values.dtype
        and keys.is_contiguous()
        and values.is_contiguous()
    )


def native_prefill_ok(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> bool:
    """Whether ms_attn_prefill takes these (the shapes and types it is written for)."""
    D = q.shape[2]
    return (
        q.dtype == torch.float32
        and keys.dtype in kernels.KV_TYPES
        and keys.dtype == values.dtype
        and keys.is_contiguous()
        and values.is_contiguous()
        and keys.shape == values.shape
        and D == keys.shape[2]
        and D % 8 == 0
        and D <= 512
        and q.shape[1] % keys.shape[1] == 0
        and pos + q.shape[0] <= keys.shape[0]
    )


def attend_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, chunk: int) -> torch.Tensor:
    """KVCache.attend with torch's SDPA, where the native library or its shapes are missing (and the baseline
    of bench/micro.py attention): keys and values in float once, then the queries `chunk` at a time, each over the
    keys up to its own last position, as the micro-batch of those tokens would."""
    T, S = q.shape[0], keys.shape[0]
    kh = keys.float().transpose(0, 1).unsqueeze(0)
    vh = values.float().transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != keys.shape[1]
    out = torch.empty(T, q.shape[1], values.shape[2])
    for a, b in query_chunks(T, chunk):
        qh = q[a:b].transpose(0, 1).unsqueeze(0)
        end = S - T + b  # keys through this chunk's last query
        with wide_torch():
            o = F.scaled_dot_product_attention(
                qh, kh[:, :, :end], vh[:, :, :end], attn_mask=causal_mask(b - a, end, pos + a), enable_gqa=gqa
            )
        out[a:b] = o.squeeze(0).transpose(0, 1)
    return out


SINK_SCORES_BYTES = 32 << 20  # float32 scores attend_with_sinks holds at a time (query rows chunked to fit)


def attend_with_sinks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, sinks: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """Causal attention of q [T, H, D] (positions pos..) over keys/values [S, Hkv, D] (positions 0..) with a
    learned logit per head (sinks [H]) that joins every row's softmax and carries no value, so a head can
    attend to nothing (GPT-OSS). window > 0: a query sees only itself and the window - 1 positions before
    it. A decode token runs the native loop over the keys it sees (a window is a slice of the cache); a
    prompt's queries run sinks_torch."""
    first = max(0, pos - window + 1) if window else 0  # no query of this call sees a key before it
    if q.shape[0] == 1 and pos + 1 == keys.shape[0] and native_decode_ok(q, keys, values):
        out = kernels.attn_decode(q, keys[first:], values[first:], sinks)
        if out is not None:
            return out
    return sinks_torch(q, keys, values, pos, sinks, window)


def sinks_torch(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, sinks: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """attend_with_sinks in torch: scores built explicitly in float32, a chunk of query rows at a time."""
    T, H, D = q.shape
    S, Hkv = keys.shape[0], keys.shape[1]
    rep = H // Hkv
    first = max(0, pos - window + 1) if window else 0
    # keys and values widened once into contiguous [Hkv, S', D]: the products are then plain batched matmuls,
    # where a broadcast over the query heads of a kv head would have torch copy the keys per head, strided
    kh = keys[first:].transpose(0, 1).float().contiguous()
    vh = values[first:].transpose(0, 1).float().contiguous()
    qh = q.float().reshape(T, Hkv, rep, D).permute(1, 2, 0, 3)  # query head h reads kv head h // rep
    kpos = torch.arange(first, S)
    sink = sinks.float().reshape(Hkv, rep, 1, 1)
    out = torch.empty(Hkv, rep, T, D)
    step = max(1, SINK_SCORES_BYTES // (4 * H * (S - first + 1)))
    with wide_torch():
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            n = t1 - t0
            qc = qh[:, :, t0:t1].reshape(Hkv, rep * n, D)
            scores = torch.bmm(qc, kh.transpose(1, 2)).view(Hkv, rep, n, -1) / math.sqrt(D)
            dist = torch.arange(pos + t0, pos + t1)[:, None] - kpos[None, :]
            hidden = dist < 0
            if window:
                hidden |= dist >= window
            scores = scores.masked_fill(hidden, float("-inf"))
            logits = torch.cat([scores, sink.expand(Hkv, rep, n, 1)], dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :-1]
            out[:, :, t0:t1] = torch.bmm(probs.reshape(Hkv, rep * n, -1), vh).view(Hkv, rep, n, D)
    return out.permute(2, 0, 1, 3).reshape(T, H, D)
