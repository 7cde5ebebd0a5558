"""DeepSeek-V4's attention and its cache: shared-KV multi-query attention over a sliding window of raw
entries plus, per the layer's compress rate, compressed entries (paper §2.3):

  - rate 0, sliding window only;
  - rate 4, compressed sparse attention (CSA): each entry pools 8 tokens' projections (the previous window's
    `Ca` half and this window's `Cb` half, softmax-gated per channel with a learned position bias), and a
    lightning indexer (its own compressor at index_head_dim) keeps for each query the top-k entries by
    sum_h w_h relu(q_h . k) (compressed_indexer.py);
  - rate 128, heavily compressed attention (HCA): one entry per 128 tokens, no overlap, no indexer.

A query at position t sees the raw entries t - window + 1 .. t and the compressed entries whose window has
closed (w < (t + 1) // rate; CSA: those the indexer kept). Keys are values (one head, K = V), the rotary dims
(the trailing rope_dim of each head, interleaved pairs) rotate by position, and the output's rotary dims
rotate back by the query's position; a learned sink per head joins each softmax.

The cache keeps what this needs and no more: a ring of the last raw entries (window + RESUME_SLACK), a ring
of the compressors' per-token projections (2 windows + RESUME_SLACK), and every compressed entry (ctx / rate
of them). A prompt can resume (truncate, restore) up to RESUME_SLACK positions before the cache's end;
further back it starts over (resumable says which).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moestream.models.hyper import unweighted_rms
from moestream.models.kv_cache import QUERY_CHUNK, KVSnapshot, as_cached
from moestream.models.layer import SplitMixer
from moestream.models.loader import Weights
from moestream.models.ops import rms_norm, wide_torch
from moestream.models.rows import Ops

CSA_RATE = 4  # the rate whose layers overlap their windows and run the lightning indexer
RESUME_SLACK = 256  # positions a truncate may go back and still resume (the rings hold them)
NEG_INF = float("-inf")


class Rotary:
    """V4's rotary tables: interleaved pairs on the trailing rope_dim of a vector, cos/sin from
    position * inv_freq in float32 (as the reference computes them)."""

    def __init__(self, inv_freq: torch.Tensor, rope_dim: int):
        self.inv_freq = inv_freq.float()
        self.rope_dim = rope_dim

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [T, ..., D] float32 at positions [T]: its trailing rope_dim rotated (by -angle when inverse), in
        place (every caller hands over a tensor of its own); returns x."""
        cos, sin = self.tables(positions)
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if inverse:
            sin = -sin
        rot = x[..., -self.rope_dim :]
        a, b = rot[..., 0::2].clone(), rot[..., 1::2].clone()
        rot[..., 0::2] = a * cos - b * sin
        rot[..., 1::2] = b * cos + a * sin
        return x


@dataclass(frozen=True)
class CompressorSpec:
    rate: int
    width: int  # the entries' size (head_dim, or index_head_dim for the indexer)
    overlap: bool  # CSA's two series (2 x width per token) pooled over 2 windows

    @property
    def src_width(self) -> int:
        """Per-token projections kept: kv and gate, each 2 x width with overlap."""
        return 2 * self.width * (2 if self.overlap else 1)


def pool(src: torch.Tensor, first_window: int, n: int, spec: CompressorSpec, ape: torch.Tensor) -> torch.Tensor:
    """The pooled (not yet normed) entries of windows first_window .. first_window + n - 1, from the
    projections `src` [L, src_width] of the tokens from window first_window - 1 (overlap; window 0's missing
    predecessor counts as zero kv with -inf gate) or first_window on. Returns [n, width]."""
    r, d = spec.rate, spec.width
    half = src.shape[1] // 2
    kv, gate = src[:, :half].float(), src[:, half:].float()
    if not spec.overlap:
        kv = kv.view(n, r, d)
        gate = gate.view(n, r, d) + ape
        return (kv * torch.softmax(gate, dim=1)).sum(dim=1)
    lead = 1 if first_window > 0 else 0  # src starts one window early unless that window would be -1
    kv = kv.view(n + lead, r, 2 * d)
    gate = gate.view(n + lead, r, 2 * d) + ape
    if not lead:
        kv = torch.cat([torch.zeros(1, r, 2 * d), kv])
        gate = torch.cat([torch.full((1, r, 2 * d), NEG_INF), gate])
    pk = torch.cat([kv[:-1, :, :d], kv[1:, :, d:]], dim=1)  # [n, 2r, d]: previous Ca, then this window's Cb
    pg = torch.cat([gate[:-1, :, :d], gate[1:, :, d:]], dim=1)
    return (pk * torch.softmax(pg, dim=1)).sum(dim=1)


class LayerCache:
    """One layer's raw ring, and with a compress rate its compressors' projections and entries."""

    def __init__(self, head_dim: int, window: int, ctx: int, dtype: torch.dtype,
                 specs: tuple[CompressorSpec, ...]):  # fmt: skip
        self.ring = window + RESUME_SLACK
        # float32 whatever the cache's dtype: the ring is a fixed few hundred entries, and values read back
        # from it equal the span's own (a prompt gives the bits of its tokens run one by one)
        self.raw = torch.zeros(self.ring, head_dim, dtype=torch.float32)
        self.specs = specs
        self.src_ring = [2 * s.rate + RESUME_SLACK for s in specs]
        self.src = [torch.zeros(n, s.src_width, dtype=torch.float32) for n, s in zip(self.src_ring, specs, strict=True)]
        # float32 as well: an entry pools projections whose last bits depend on the span's size (torch's GEMM),
        # and rounded to float16 one in a thousand would land on the other side of a rounding step
        self.entries = [torch.zeros(ctx // s.rate + 1, s.width, dtype=torch.float32) for s in specs]

    def tensors(self) -> list[torch.Tensor]:
        return [self.raw, *self.src, *self.entries]

    @staticmethod
    def ring_rows(ring: torch.Tensor, start: int, end: int) -> torch.Tensor:
        n = ring.shape[0]
        idx = torch.arange(start, end) % n
        return ring[idx]

    @staticmethod
    def ring_write(ring: torch.Tensor, pos: int, rows: torch.Tensor) -> None:
        """Rows of positions pos.. into the ring (only the last ring-size of them survive)."""
        n, T = ring.shape[0], rows.shape[0]
        m = min(T, n)
        ring[torch.arange(pos + T - m, pos + T) % n] = rows[T - m :]


class CompressedKVCache:
    """One sequence's cache for every layer of a V4 model (see the module's docstring)."""

    def __init__(self, head_dim: int, window: int, ctx: int, dtype: torch.dtype,
                 layer_specs: list[tuple[CompressorSpec, ...]]):  # fmt: skip
        self.ctx, self.dtype, self.window, self.length = ctx, dtype, window, 0
        self.query_chunk = QUERY_CHUNK
        self.layers = [LayerCache(head_dim, window, ctx, dtype, s) for s in layer_specs]
        self.step_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    @staticmethod
    def bytes_for(ratios: tuple[int, ...], head_dim: int, window: int, index_dim: int, ctx: int, exact: bool) -> int:
        """What the cache of these layers holds at ctx positions (float32 throughout, exact or not)."""
        n = 0
        for rate in ratios:
            n += (window + RESUME_SLACK) * head_dim * 4
            for spec in layer_specs(rate, head_dim, index_dim):
                n += (2 * spec.rate + RESUME_SLACK) * spec.src_width * 4 + (ctx // spec.rate + 1) * spec.width * 4
        return n

    # -- the forward step's protocol ------------------------------------------------------------------

    def begin_step(self, pos: int, n: int) -> None:
        if pos != self.length:
            raise ValueError(
                f"the compressed cache holds {self.length} positions but the step is at {pos}; truncate it first"
            )
        self.step_tokens = n

    def end_step(self, pos: int, n: int) -> None:
        self.length = pos + n
        self.step_tokens = 0

    def abort_step(self, pos: int) -> None:
        # the rings were written from pos on: what they held before is intact while the step was short
        self.length = pos if self.step_tokens <= RESUME_SLACK else 0
        self.step_tokens = 0

    def advance(self, length: int) -> None:
        self.length = length

    def resumable(self, length: int) -> int:
        length = min(length, self.length)
        return length if length >= self.length - RESUME_SLACK else 0

    def truncate(self, length: int) -> int:
        self.length = self.resumable(length)
        return self.length

    def snapshot(self, length: int) -> KVSnapshot:
        """The rings whole and the compressed entries held so far: resumable at the cache's length (and, after
        a restore, as truncate allows)."""
        rows = [t[: self._held(t)].clone() for t in self.rows()]
        return KVSnapshot(self.length, rows, [(self.length, {}, {})])

    def restore(self, snap: KVSnapshot, length: int) -> int:
        for t, saved in zip(self.rows(), snap.rows, strict=True):
            t[: saved.shape[0]] = saved
        self.length = snap.length
        return self.truncate(length)

    def _held(self, t: torch.Tensor) -> int:
        """Rows of `t` that hold something: a ring's all, an entry table's closed windows (and one more)."""
        for layer in self.layers:
            for spec, entries in zip(layer.specs, layer.entries, strict=True):
                if t is entries:
                    return min(t.shape[0], self.length // spec.rate + 1)
        return t.shape[0]

    def rows(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    # -- what a layer reads and writes ----------------------------------------------------------------

    def window_keys(self, layer: int, pos: int, kv: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The raw entries a span of T tokens at pos attends ([S, D], from position `first`), the span's
        own `kv` [T, D] stored."""
        lc = self.layers[layer]
        first = max(0, pos - self.window + 1)
        keys = torch.cat([lc.ring_rows(lc.raw, first, pos), kv.float()])
        LayerCache.ring_write(lc.raw, pos, kv.float())
        return keys, first

    def compress(self, layer: int, which: int, pos: int, src: torch.Tensor, ape: torch.Tensor,
                 finish) -> torch.Tensor:  # fmt: skip
        """Every entry of compressor `which` through position pos + T - 1 [n, width]: the windows that close
        within this span pooled (pool) and finished (`finish`: norm and rotary, given the window ids), the
        span's projections `src` [T, src_width] kept."""
        lc = self.layers[layer]
        spec, ring, entries = lc.specs[which], lc.src[which], lc.entries[which]
        r, T = spec.rate, src.shape[0]
        done, total = pos // r, (pos + T) // r  # windows closed before the span, and after it
        if total > done:
            start = max(0, (done - 1) * r) if spec.overlap else done * r
            local = torch.cat([lc.ring_rows(ring, start, pos), src.float()])
            n = total - done
            local = local[: (total * r) - start]
            pooled = pool(local, done, n, spec, ape)
            entries[done:total] = as_cached(finish(pooled, torch.arange(done, total)), entries.dtype)
        LayerCache.ring_write(ring, pos, src.float())
        return entries[:total]


@dataclass(frozen=True)
class AttentionShape:
    """What one V4 attention layer needs of the model's config."""

    hidden: int
    n_heads: int
    head_dim: int
    q_lora_rank: int
    window: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_dim: int
    index_topk: int
    rms_eps: float
    rate: int  # this layer's compress rate: 0, 4 (with the indexer) or 128

    def specs(self) -> tuple[CompressorSpec, ...]:
        return layer_specs(self.rate, self.head_dim, self.index_dim)


def layer_specs(rate: int, head_dim: int, index_dim: int) -> tuple[CompressorSpec, ...]:
    """A layer's compressors: the attention's, then (CSA) the indexer's."""
    if not rate:
        return ()
    main = CompressorSpec(rate, head_dim, rate == CSA_RATE)
    if rate != CSA_RATE:
        return (main,)
    return main, CompressorSpec(rate, index_dim, True)


class CompressedAttention(SplitMixer):
    """One V4 attention layer (the module's docstring); its rotary is the model's Rotaries `main` (sliding
    layers) or `compress` (CSA, HCA)."""

    def __init__(self, w: Weights, i: int, s: AttentionShape):
        p, H, D, nh = f"blk.{i}.", s.hidden, s.head_dim, s.n_heads
        self.s = s
        specs = s.specs()
        parts = [(p + "attn_q_a.weight", s.q_lora_rank, H), (p + "attn_kv.weight", D, H)]
        if specs:
            cw = specs[0].src_width // 2
            parts += [(p + "attn_compressor_kv.weight", cw, H), (p + "attn_compressor_gate.weight", cw, H)]
            self.ape = w.matrix(p + "attn_compressor_ape.weight", s.rate, cw)
            self.comp_norm = w.vector(p + "attn_compressor_norm.weight", D)
        second = [(p + "attn_q_b.weight", nh * D, s.q_lora_rank)]
        if len(specs) > 1:
            iw = specs[1].src_width // 2
            parts += [(p + "indexer_compressor_kv.weight", iw, H), (p + "indexer_compressor_gate.weight", iw, H),
                      (p + "indexer.proj.weight", s.index_heads, H)]  # fmt: skip
            second.append((p + "indexer.attn_q_b.weight", s.index_heads * s.index_dim, s.q_lora_rank))
            self.idx_ape = w.matrix(p + "indexer_compressor_ape.weight", s.rate, iw)
            self.idx_norm = w.vector(p + "indexer_compressor_norm.weight", s.index_dim)
        self.a, self.b = w.fused(parts), w.fused(second)
        self.q_a_norm = w.vector(p + "attn_q_a_norm.weight", s.q_lora_rank)
        self.kv_norm = w.vector(p + "attn_kv_a_norm.weight", D)
        self.sinks = w.vector(p + "attn_sinks.weight", nh)
        self.o_a = w.linear_groups(p + "attn_output_a.weight", s.o_groups, s.o_groups * s.o_lora_rank,
                                   nh * D // s.o_groups)  # fmt: skip
        self.o_b = w.linear(p + "attn_output_b.weight", H, s.o_groups * s.o_lora_rank)

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]:
        """(q, normed kv, the compressors' projections..., the indexer's q and head weights)."""
        a = ops.mm(self.a, x)
        qr = ops.norm(a[0], self.q_a_norm, self.s.rms_eps)
        b = ops.mm(self.b, qr)
        kv = ops.norm(a[1], self.kv_norm, self.s.rms_eps)
        if len(a) == 7:  # CSA: the indexer's q, then its per-head weights last
            return (b[0], kv, a[2], a[3], a[4], a[5], b[1], a[6])
        return (b[0], kv, *a[2:])

    def output(self, a: torch.Tensor, ops: Ops) -> torch.Tensor:
        g = a.view(a.shape[0], self.s.o_groups, -1)
        mid = torch.cat([ops.mm(lin, g[:, j].contiguous()) for j, lin in enumerate(self.o_a)], dim=1)
        return ops.mm(self.o_b, mid)

    def core(self, parts: tuple[torch.Tensor, ...], layer: int, cache: CompressedKVCache, pos: int,
             rope: Any) -> torch.Tensor:  # fmt: skip
        s = self.s
        q, kv = parts[0], parts[1]
        T, nh, D = q.shape[0], s.n_heads, s.head_dim
        rot: Rotary = rope.compress if s.rate else rope.main
        positions = torch.arange(pos, pos + T)
        q = rot.rotate(unweighted_rms(q.float().view(T, nh, D), s.rms_eps), positions)
        keys, first = cache.window_keys(layer, pos, rot.rotate(kv.float(), positions))
        kpos = torch.arange(first, pos + T)
        dist = positions[:, None] - kpos[None, :]
        mask = (dist >= 0) & (dist < s.window)
        if s.rate:
            entries, seen = self._compressed(parts, layer, cache, pos, rot, positions)
            keys = torch.cat([keys, entries.to(keys.dtype)])
            mask = torch.cat([mask, seen], dim=1)
        out = attend_shared_kv(q, keys.float(), mask, self.sinks, D**-0.5)
        return rot.rotate(out, positions, inverse=True).reshape(T, nh * D)

    def _compressed(self, parts: tuple[torch.Tensor, ...], layer: int, cache: CompressedKVCache, pos: int,
                    rot: Rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The compressed entries [n, D] and which each query sees [T, n]."""
        s = self.s
        eps = s.rms_eps

        def finish(norm: torch.Tensor):
            return lambda pooled, windows: rot.rotate(rms_norm(pooled, norm, eps), windows * s.rate)

        src = torch.cat([parts[2], parts[3]], dim=1)
        entries = cache.compress(layer, 0, pos, src, self.ape, finish(self.comp_norm))
        closed = (positions + 1) // s.rate  # query t sees the windows closed by t
        seen = torch.arange(entries.shape[0])[None, :] < closed[:, None]
        if s.rate != CSA_RATE:
            return entries, seen
        keys = cache.compress(layer, 1, pos, torch.cat([parts[4], parts[5]], dim=1), self.idx_ape,
                              finish(self.idx_norm))  # fmt: skip
        T = positions.shape[0]
        iq = rot.rotate(parts[6].float().view(T, s.index_heads, s.index_dim), positions)
        head_w = parts[7].float() * s.index_heads**-0.5
        return entries, seen & indexer_choice(iq, keys.float(), head_w, seen, s.index_topk, s.index_dim**-0.5)


def indexer_choice(q: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, seen: torch.Tensor, topk: int,
                   scale: float) -> torch.Tensor:  # fmt: skip
    """The lightning indexer's pick [T, n]: for each query the top-k entries it may see by
    sum_h head_w[t, h] relu(q[t, h] . k) scale (entries it may not see are never picked)."""
    n = keys.shape[0]
    if n == 0:
        return seen
    scores = torch.relu(torch.einsum("thd,sd->ths", q, keys)) * scale
    score = (scores * head_w.unsqueeze(-1)).sum(dim=1).masked_fill(~seen, NEG_INF)
    top = score.topk(min(topk, n), dim=-1).indices
    return torch.zeros_like(seen).scatter_(1, top, True)


def attend_shared_kv(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:  # fmt: skip
    """Attention of q [T, H, D] over one shared key/value head keys [S, D] where mask [T, S], a sink logit per
    head joining each softmax; [T, H, D]."""
    T, H, _ = q.shape
    with wide_torch():
        scores = torch.einsum("thd,sd->hts", q, keys) * scale
        scores = scores.masked_fill(~mask[None], NEG_INF)
        logits = torch.cat([scores, sinks.view(H, 1, 1).expand(H, T, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.einsum("hts,sd->thd", probs, keys)
