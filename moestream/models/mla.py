"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2: GGUF arch `deepseek2`).

Each token's keys and values come from one compressed latent c = RMSNorm(W_DKV x) of kv_lora_rank values
plus one rotary key k_pe shared by every head; head h's key is [W_UK_h c | k_pe] and its value W_UV_h c.
The cache holds only c and k_pe (576 values a token a layer for V3, against 2 x 128 heads x 192/128 for
full keys and values). Attention then runs in one of two equal forms:
  - absorbed (decode, and long spans): W_UK_h folds into the query (q_lat_h = W_UK_h^T q_nope_h), so the
    scores are q_lat_h . c_s + q_pe_h . k_pe_s and the output W_UV_h sum_s p_s c_s, one key of 576 values
    shared by all heads, as llama.cpp computes it;
  - naive (a prompt's first micro-batches): the span's keys and values decompressed, then ordinary
    attention; fewer operations while the span is no longer than about twice the micro-batch.
The rotary dims are interleaved pairs (x0, x1), (x2, x3)... in the file; they are de-interleaved into
halves before the NeoX-style rotation, in queries and keys alike, which leaves every dot product the same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from moestream.compute import kernels
from moestream.compute.linear import QLinear
from moestream.errors import ComputeError
from moestream.models.attention import causal_mask, query_chunks
from moestream.models.kv_cache import QUERY_CHUNK, KVCache, as_cached
from moestream.models.layer import SplitMixer
from moestream.models.loader import Weights
from moestream.models.ops import wide_torch
from moestream.models.rope import RoPE
from moestream.models.rows import Ops

MaskOf = Callable[[int, int, int], "torch.Tensor | None"]  # (first query, last + 1, keys) -> [queries, keys]
NATIVE_DTYPES = tuple(kernels.KV_TYPES)  # cache dtypes the native decode step reads
# the per-head up-projections: at their file's bits where the lane kernels take them, else dense (UpProjections)
UP_PROJECTIONS = ("attn_k_b.weight", "attn_v_b.weight", "attn_kv_b.weight")


class UpProjections:
    """One layer's per-head up-projections: k_b [H, L, nope] (W_UK_h transposed) takes a query into the latent
    space, v_b [H, v, L] (W_UV_h) a latent output to the head's values. A decode step reads all of them (2 x 128
    heads x 64K values a layer for V3): each is held at its file's bits where the lane kernels take it (`k_lane`,
    `v_lane`: the heads' matrices stacked, multiplied against int8-quantized activations as every other matrix
    is), else dense (`k_b`, `v_b`: bf16, float32 when exact). Newer converters store them split, older ones as
    one attn_kv_b [H * (nope + v), L], held dense."""

    def __init__(self, w: Weights, p: str, cfg: Any):
        nh, L, nope, v = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope, cfg.v_head_dim
        self.heads, self.latent, self.nope, self.v = nh, L, nope, v
        wdt = torch.float32 if w.exact else torch.bfloat16
        self.k_lane = self.v_lane = None
        self.k_b = self.v_b = None
        if w.has(p + "attn_k_b.weight"):
            self.k_lane = w.per_head(p + "attn_k_b.weight", nh, L, nope)
            self.v_lane = w.per_head(p + "attn_v_b.weight", nh, v, L)
            if self.k_lane is None:
                self.k_b = w.array(p + "attn_k_b.weight", (nh, L, nope), wdt)
            if self.v_lane is None:
                self.v_b = w.array(p + "attn_v_b.weight", (nh, v, L), wdt)
        else:
            kv_b = w.array(p + "attn_kv_b.weight", (nh * (nope + v), L), wdt).view(nh, nope + v, L)
            self.k_b = kv_b[:, :nope].transpose(1, 2).contiguous()
            self.v_b = kv_b[:, nope:].contiguous()

    @property
    def dense(self) -> bool:
        """Both held dense (the decode step's one C call reads them in place)."""
        return self.k_lane is None and self.v_lane is None

    def widened(self) -> UpProjections:
        """The same projections with the dense ones widened to float32 once, for a loop over query chunks (each
        absorb/values call would widen them again); the ones at the file's bits stay as they are."""
        wide = copy.copy(self)
        wide.k_b = None if self.k_b is None else self.k_b.float()
        wide.v_b = None if self.v_b is None else self.v_b.float()
        return wide

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] -> the queries in the latent space [T, H, L]."""
        if self.k_lane is not None:
            return _grouped(self.k_lane, q_nope.transpose(0, 1)).transpose(0, 1)
        with wide_torch():
            return torch.bmm(q_nope.transpose(0, 1), self.k_b.float().transpose(1, 2)).transpose(0, 1)

    def values(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Latent outputs [T, H, L] -> the heads' values [T, H, v]."""
        if self.v_lane is not None:
            return _grouped(self.v_lane, o_lat.transpose(0, 1)).transpose(0, 1)
        with wide_torch():
            return torch.bmm(o_lat.transpose(0, 1), self.v_b.float().transpose(1, 2)).transpose(0, 1)

    def k_dense(self) -> torch.Tensor:
        """k_b as float32 [H, L, nope] (widened for the call where it is held at its file's bits)."""
        if self.k_lane is not None:
            return self.k_lane.dense().view(self.heads, self.latent, self.nope)
        return self.k_b.float()

    def v_dense(self) -> torch.Tensor:
        """v_b as float32 [H, v, L]."""
        if self.v_lane is not None:
            return self.v_lane.dense().view(self.heads, self.v, self.latent)
        return self.v_b.float()


class MLACache:
    """Latents and rotary keys of every layer at the full context, allocated once up front."""

    def __init__(self, n_layers: int, kv_lora: int, rope_dim: int, ctx: int, dtype: torch.dtype):
        self.ctx, self.dtype, self.length = ctx, dtype, 0
        self.query_chunk = QUERY_CHUNK  # queries attended at once (see KVCache.query_chunk)
        self.latent = [torch.zeros(ctx, kv_lora, dtype=dtype) for _ in range(n_layers)]
        self.rope = [torch.zeros(ctx, rope_dim, dtype=dtype) for _ in range(n_layers)]

    @staticmethod
    def bytes_for(n_layers: int, kv_lora: int, rope_dim: int, ctx: int, exact: bool) -> int:
        return n_layers * ctx * (kv_lora + rope_dim) * (4 if exact else 2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.latent + self.rope)

    def update(self, layer: int, pos: int, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store positions pos..pos+T-1; returns every position's latents [S, L] and rotary keys [S, R]."""
        T = c.shape[0]
        self.latent[layer][pos : pos + T] = as_cached(c, self.dtype)
        self.rope[layer][pos : pos + T] = as_cached(k_pe, self.dtype)
        return self.latent[layer][: pos + T], self.rope[layer][: pos + T]

    def advance(self, length: int) -> None:
        self.length = length

    def truncate(self, length: int) -> int:
        self.length = min(self.length, length)
        return self.length

    def rows(self) -> list[torch.Tensor]:
        return self.latent + self.rope

    begin_step = KVCache.begin_step
    end_step = KVCache.end_step
    abort_step = KVCache.abort_step
    resumable = KVCache.resumable
    snapshot = KVCache.snapshot
    restore = KVCache.restore


def deinterleave(rope_dim: int) -> torch.Tensor:
    """Indices taking interleaved pairs (x0, x1), (x2, x3)... to halves (x0, x2, ... | x1, x3, ...)."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, max(rope_dim, 1), 2)])


def _grouped(lin: QLinear, x: torch.Tensor) -> torch.Tensor:
    """x [H, T, K] through a lane weight of H stacked matrices, each head's rows times its own inputs: [H, T, n]."""
    if x.shape[2] != lin.in_features:
        raise ComputeError(f"grouped products of {tuple(lin.shape)} got an input of {tuple(x.shape)}")
    return kernels.qmm_groups(lin.weight, lin.ggml_type, lin.out_features, x)


class MLAttention(SplitMixer):
    """One layer's attention. cfg: n_heads, q_lora_rank (0: one plain attn_q), kv_lora_rank, qk_nope, qk_rope,
    v_head_dim, hidden, rms_eps, kq_scale."""

    def __init__(self, w: Weights, i: int, cfg: Any, extra: Sequence[tuple[str, int, int]] = ()):
        """extra: more projections of the block's input (name, rows, cols), fused into the first matmul and
        returned after the compression by `self.a` (the sparse attention's indexer)."""
        p = f"blk.{i}."
        H, nh, L, R = cfg.hidden, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope
        v, qk = cfg.v_head_dim, cfg.qk_nope + cfg.qk_rope
        self.cfg = cfg
        # the query's first projection and the kv compression read the same input: one matmul
        if cfg.q_lora_rank:
            self.a = w.fused([(p + "attn_q_a.weight", cfg.q_lora_rank, H), (p + "attn_kv_a_mqa.weight", L + R, H),
                              *extra])  # fmt: skip
            self.q_a_norm = w.vector(p + "attn_q_a_norm.weight", cfg.q_lora_rank)
            self.q_b = w.linear(p + "attn_q_b.weight", nh * qk, cfg.q_lora_rank)
        else:
            self.a = w.fused([(p + "attn_q.weight", nh * qk, H), (p + "attn_kv_a_mqa.weight", L + R, H), *extra])
        self.kv_a_norm = w.vector(p + "attn_kv_a_norm.weight", L)
        self.up = UpProjections(w, p, cfg)
        self.o = w.linear(p + "attn_output.weight", H, nh * v)
        self.perm = deinterleave(R)

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]:
        """The row-wise part: (q [T, H * (nope + rope)], the kv compression [T, L + R], latent c [T, L])."""
        cfg = self.cfg
        if cfg.q_lora_rank:
            qa, kv = ops.mm(self.a, x)
            q = ops.mm(self.q_b, ops.norm(qa, self.q_a_norm, cfg.rms_eps))
        else:
            q, kv = ops.mm(self.a, x)
        return q, kv, ops.norm(kv[:, : cfg.kv_lora_rank], self.kv_a_norm, cfg.rms_eps)

    def output(self, a: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.mm(self.o, a)

    def core(self, parts: tuple[torch.Tensor, ...], layer: int, cache: MLACache, pos: int, rope: RoPE) -> torch.Tensor:
        """RoPE at pos.., the cache update and attention: [T, H * v_head_dim]."""
        q_nope, q_pe, latents, keys = self.rotate_and_store(parts, layer, cache, pos, rope)
        return self.attend(q_nope, q_pe, latents, keys, pos, cache.query_chunk)

    def rotate_and_store(
        self, parts: tuple[torch.Tensor, ...], layer: int, cache: MLACache, pos: int, rope: RoPE
    ) -> tuple[torch.Tensor, ...]:
        """(q_nope [T, H, nope], q_pe [T, H, rope] rotated, every position's latents and rotary keys) with
        this span's stored."""
        cfg = self.cfg
        q, kv, c = parts[:3]
        T, L = q.shape[0], cfg.kv_lora_rank
        q = q.reshape(T, cfg.n_heads, cfg.qk_nope + cfg.qk_rope)
        q_pe = rope(q[..., cfg.qk_nope :][..., self.perm], pos)
        k_pe = rope(kv[:, None, L:][..., self.perm], pos)[:, 0]
        latents, keys = cache.update(layer, pos, c, k_pe)
        return q[..., : cfg.qk_nope], q_pe, latents, keys

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, keys: torch.Tensor, pos: int,
               query_chunk: int, mask_of: MaskOf | None = None) -> torch.Tensor:  # fmt: skip
        """Attention of T queries at pos.. over the positions' latents and rotary keys: [T, H * v_head_dim].
        mask_of(a, b, end): the [b - a, end] keys queries a..b-1 may see (None: the causal mask)."""
        cfg = self.cfg
        T, S, L = q_nope.shape[0], latents.shape[0], cfg.kv_lora_rank
        # a long span attends `query_chunk` queries at a time, each chunk over the positions up to its own
        # last one and in the form its micro-batch would take: buffers stay chunk-sized
        out = torch.empty(T, cfg.n_heads, cfg.v_head_dim)
        if T > query_chunk:  # in float once for every chunk (each form's .float() is then a no-op)
            latents, keys = latents.float(), keys.float()
        for a, b in query_chunks(T, query_chunk):
            n, end = b - a, S - T + b
            mask = mask_of(a, b, end) if mask_of is not None else causal_mask(n, end, pos + a)
            if n > 1 and end * (cfg.qk_nope + cfg.qk_rope + cfg.v_head_dim) <= n * (2 * L + cfg.qk_rope):
                out[a:b] = self.naive(q_nope[a:b], q_pe[a:b], latents[:end], keys[:end], mask)
            else:
                out[a:b] = self.absorbed(q_nope[a:b], q_pe[a:b], latents[:end], keys[:end], mask)
        return out.reshape(T, cfg.n_heads * cfg.v_head_dim)

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, keys: torch.Tensor,
                 mask: torch.Tensor | None, rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Attention over the cached latents without decompressing them (one query: over every one of them, or
        over `rows` of them in that order; mask: the [T, S] keys each query sees); returns [T, H, v]."""
        scale, up = self.cfg.kq_scale, self.up
        T = q_nope.shape[0]
        if T == 1 and kernels.available() and latents.dtype == keys.dtype in NATIVE_DTYPES and keys.shape[1]:
            # the decode step on the lane pool (no torch op, so torch can stay at one thread), reading the cache
            # in its own dtype, the chosen rows in place: one C call over dense up-projections, else the latent
            # attention between the two grouped products at the file's bits
            if up.dense:
                return kernels.mla_decode(q_nope, q_pe, up.k_b, up.v_b, latents, keys, self.cfg.v_head_dim, scale,
                                          rows)  # fmt: skip
            o_lat = kernels.mla_decode(up.absorb(q_nope), q_pe, None, None, latents, keys, 0, scale, rows)
            return up.values(o_lat)
        if rows is not None:
            latents, keys = latents[rows], keys[rows]
        lat, kpe = latents.float(), keys.float()
        q_lat = up.absorb(q_nope).transpose(0, 1)  # [H, T, L]
        if T == 1:
            scores = (q_lat[:, 0] @ lat.T + q_pe[0] @ kpe.T) * scale  # [H, S]
            o_lat = torch.softmax(scores, dim=-1) @ lat  # [H, L]
            return up.values(o_lat[None])  # [1, H, v]
        # one shared key [c | k_pe] of L + R values for every head: multi-query attention
        q = torch.cat([q_lat, q_pe.transpose(0, 1)], dim=-1)[None]  # [1, H, T, L + R]
        k = torch.cat([lat, kpe], dim=-1)[None, None]
        with wide_torch():
            o_lat = F.scaled_dot_product_attention(q, k, lat[None, None], attn_mask=mask, scale=scale, enable_gqa=True)[
                0
            ]  # [H, T, L]
        return up.values(o_lat.transpose(0, 1))

    def naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, keys: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """Attention with the span's keys and values decompressed from the latents; returns [T, H, v]."""
        H = q_nope.shape[1]
        lat, kpe = latents.float(), keys.float()
        S = lat.shape[0]
        with wide_torch():
            k_nope = torch.matmul(lat[None], self.up.k_dense())  # [H, S, nope]
            v = torch.matmul(lat[None], self.up.v_dense().transpose(1, 2))  # [H, S, v]
            k = torch.cat([k_nope, kpe[None].expand(H, S, -1)], dim=-1)[None]
            q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(q, k, v[None], attn_mask=mask, scale=self.cfg.kq_scale)
        return out[0].transpose(0, 1)
