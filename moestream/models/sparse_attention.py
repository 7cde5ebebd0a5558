"""DeepSeek Sparse Attention (DeepSeek-V3.2: GGUF arch `deepseek32`; GLM-5: `glm-dsa`): latent attention
(mla.py) over the top_k earlier tokens a lightning indexer picks for each query, not over every one.

The indexer, as both references compute it (transformers' DeepseekV32Indexer / GlmMoeDsaIndexer, llama.cpp's
deepseek32.cpp / glm-dsa.cpp):
  - one key a token and layer, k = LayerNorm(W_k x) (head_dim values, eps 1e-6, with a bias), cached here
    beside the latents (DSACache.index_keys);
  - `heads` queries q_h = W_qb qr from the normed query LoRA qr the attention's own query comes from;
  - both rotated on their first qk_rope dims (the head is [rope | rest]): DeepSeek-V3.2 rotates halves,
    GLM-5 interleaved pairs, de-interleaved here as mla.py does (every dot product stays the same);
  - weights w_h = (W_proj x)_h / sqrt(heads), W_proj kept F32 by the converter;
  - score(t, s) = sum_h w_h relu(q_h . k_s / sqrt(head_dim)) in float32, for keys s <= t only; a query
    attends to its top_k keys by score (to all of them while it sees no more than top_k). llama.cpp's
    Hadamard rotation of q and k leaves the dot products as they are, so it is not done here.
GLM-5.2's "shared" layers run no indexer: they attend to the tokens the last full layer chose for the same
queries (attention.indexer.types).

A decode step past top_k attends to the chosen latents and rotary keys alone (the native decode kernel reads
those rows where they lie in the cache); a prompt's queries likewise, each over its own choice in one C call
per chunk of queries (attend_chosen), so a prompt position costs top_k keys, not every earlier one. Without
the native kernels (and for a pooled indexer's mask) a prompt attends chunk by chunk, as the other MLA models,
with the mask of its choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moestream.compute import kernels
from moestream.models.attention import causal_mask, query_chunks
from moestream.models.kv_cache import as_cached
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.mla import NATIVE_DTYPES, MLACache, MLAttention, deinterleave
from moestream.models.ops import wide_torch
from moestream.models.rope import RoPE
from moestream.models.rows import Ops

INDEX_NORM_EPS = 1e-6  # the indexer key's LayerNorm (both references)
INDEX_SCORES_BYTES = 32 << 20  # float32 [queries, heads, keys] products the scoring holds at a time


@dataclass(frozen=True)
class IndexerConfig:
    heads: int
    head_dim: int
    top_k: int
    full: tuple[bool, ...]  # per block: runs its own indexer (False: reuses the last full block's choice)
    interleaved: bool  # the rotary dims in interleaved pairs (GLM-5) or halves (DeepSeek-V3.2)

    @property
    def n_full(self) -> int:
        return sum(self.full)


def indexer_config(
    m: ArchMetadata,
    n_blocks: int,
    rope_dim: int,
    q_lora: int,
    *,
    interleaved: bool,
    default_full: list[bool],
    attends: list[bool] | None = None,
) -> IndexerConfig:
    """The indexer's keys (attention.indexer.*); `default_full`: each block's kind where the file has no
    attention.indexer.types; `attends`: the blocks with sparse attention where not all have it (the others
    are neither full nor shared)."""
    heads, dim = m.int("attention.indexer.head_count"), m.int("attention.indexer.key_length")
    m.require(rope_dim <= dim, "attention.indexer.key_length", f"is {dim}, fewer than the {rope_dim} rotary dims")
    m.require(q_lora > 0, "attention.q_lora_rank", "is missing; the indexer's queries come from the query LoRA")
    full = m.flags("attention.indexer.types", n_blocks) or default_full[:n_blocks]
    attends = attends or [True] * n_blocks
    first = attends.index(True) if True in attends else 0
    m.require(len(full) == n_blocks and full[first], "attention.indexer.types",
              "makes the first block a shared one; a shared block reuses an earlier block's choice")  # fmt: skip
    full = [f and a for f, a in zip(full, attends, strict=True)]
    return IndexerConfig(heads, dim, m.int("attention.indexer.top_k"), tuple(full), interleaved)


class DSACache(MLACache):
    """MLACache plus each full block's indexer keys, and what one step's blocks pass on: the choice of the
    last full block by query chunk (shared blocks read it) and the keys each block's last query attended to."""

    def __init__(self, n_layers: int, kv_lora: int, rope_dim: int, ctx: int, dtype: torch.dtype, ix: IndexerConfig):
        super().__init__(n_layers, kv_lora, rope_dim, ctx, dtype)
        self.index_keys = [torch.zeros(ctx, ix.head_dim, dtype=dtype) if f else None for f in ix.full]
        self.chosen: dict[int, torch.Tensor | None] = {}  # this step's choice, by a query chunk's first position
        self.keys_attended = [0] * n_layers

    @staticmethod
    def bytes_for(n_layers: int, kv_lora: int, rope_dim: int, ctx: int, exact: bool, index_keys: int) -> int:
        """index_keys: values a token the indexer keys take over every layer (full blocks x head_dim)."""
        return MLACache.bytes_for(n_layers, kv_lora, rope_dim, ctx, exact) + ctx * index_keys * (4 if exact else 2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows())

    def rows(self) -> list[torch.Tensor]:
        return super().rows() + [t for t in self.index_keys if t is not None]

    def store_index_keys(self, layer: int, pos: int, k: torch.Tensor) -> torch.Tensor:
        """Store positions pos..pos+T-1's indexer keys; returns every position's [S, head_dim]."""
        keys = self.index_keys[layer]
        assert keys is not None
        keys[pos : pos + k.shape[0]] = as_cached(k, self.dtype)
        return keys[: pos + k.shape[0]]

    def begin_step(self, pos: int, n: int) -> None:
        self.chosen.clear()


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, pos: int, scale: float,
                 key_pos: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """score(t, s) = sum_h weights[t, h] relu(scale q[t, h] . keys[s]) for queries q [T, heads, D] at positions
    pos.. over keys [S, D]: float32 [T, S], -inf where key s comes after query t (key_pos: the position each
    key stands at, s where None); the products a piece of queries at a time."""
    T, H, _ = q.shape
    S = keys.shape[0]
    if T == 1 and key_pos is None and S == pos + 1 and kernels.available() and keys.dtype in NATIVE_DTYPES:
        # a decode step sees every stored key: one C call reads them in the cache's dtype, on the lane pool
        return kernels.index_scores(q[0], weights[0], keys, scale)[None]
    kt = keys.float().T
    out = torch.empty(T, S)
    step = max(1, INDEX_SCORES_BYTES // (4 * H * S))
    with wide_torch():
        for a in range(0, T, step):
            b = min(T, a + step)
            s = torch.matmul(q[a:b].float(), kt).mul_(scale).relu_()  # [n, H, S]
            out[a:b] = torch.matmul(weights[a:b, None, :].float(), s)[:, 0]
    if key_pos is not None:
        return out.masked_fill_(key_pos[None, :] > torch.arange(pos, pos + T)[:, None], float("-inf"))
    mask = causal_mask(T, S, pos)
    return out if mask is None else out.masked_fill_(~mask, float("-inf"))


class SparseMLAttention(MLAttention):
    """One block's latent attention over the indexer's choice. cfg: MLAttention's fields plus `indexer`
    (IndexerConfig); a full block holds the indexer's weights, a shared one none."""

    def __init__(self, w: Weights, i: int, cfg: Any):
        ix: IndexerConfig = cfg.indexer
        p, D = f"blk.{i}.indexer.", ix.head_dim
        self.full = ix.full[i]
        # the indexer's key and weights read the block's input, as the query LoRA and the compression do
        super().__init__(w, i, cfg, self.index_inputs(i, cfg) if self.full else [])
        if self.full:
            self.index_q = w.linear(p + "attn_q_b.weight", ix.heads * D, cfg.q_lora_rank)
            self.index_norm = w.vector(p + "k_norm.weight", D)
            self.index_norm_bias = w.vector(p + "k_norm.bias", D)
        R = cfg.qk_rope
        self.index_perm = torch.cat([deinterleave(R), torch.arange(R, D)]) if ix.interleaved else None

    @staticmethod
    def index_inputs(i: int, cfg: Any) -> list[tuple[str, int, int]]:
        """The indexer's projections of the block's input (name, rows, cols): its key and head weights."""
        ix, p = cfg.indexer, f"blk.{i}.indexer."
        return [(p + "attn_k.weight", ix.head_dim, cfg.hidden), (p + "proj.weight", ix.heads, cfg.hidden)]

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]:
        """MLAttention's (q, kv, c), and in a full block the indexer's queries [T, heads * D], raw keys [T, D]
        and head weights [T, heads]."""
        cfg = self.cfg
        qa, kv, *index = ops.mm(self.a, x)
        qr = ops.norm(qa, self.q_a_norm, cfg.rms_eps)
        q, c = ops.mm(self.q_b, qr), ops.norm(kv[:, : cfg.kv_lora_rank], self.kv_a_norm, cfg.rms_eps)
        if not self.full:
            return q, kv, c
        return q, kv, c, ops.mm(self.index_q, qr), *index

    def core(self, parts: tuple[torch.Tensor, ...], layer: int, cache: DSACache, pos: int, rope: RoPE) -> torch.Tensor:
        q_nope, q_pe, latents, keys = self.rotate_and_store(parts, layer, cache, pos, rope)
        if self.full:
            cache.chosen[pos] = self.choose(parts, layer, cache, pos, rope)
        chosen = cache.chosen[pos]
        T, S = q_nope.shape[0], latents.shape[0]
        if chosen is None:  # no query sees more than top_k keys: every one of them
            cache.keys_attended[layer] = S
            return self.attend(q_nope, q_pe, latents, keys, pos, cache.query_chunk)
        # the choice: top_k positions a query [T, top_k], or (a pooled indexer's) a mask of the keys [T, S]
        as_mask = chosen.dtype == torch.bool
        cache.keys_attended[layer] = int(chosen[-1].sum()) if as_mask else chosen.shape[1]
        if T == 1:  # a decode step: the chosen latents and rotary keys as a k-token cache, in position order
            idx = chosen[0].nonzero()[:, 0] if as_mask else chosen[0]  # choose() returns a step's in order
            return self.absorbed(q_nope, q_pe, latents, keys, None, rows=idx).reshape(1, -1)

        if not as_mask and kernels.available() and latents.dtype == keys.dtype in NATIVE_DTYPES:
            return self.attend_chosen(q_nope, q_pe, latents, keys, chosen, pos, cache.query_chunk)

        def mask_of(a: int, b: int, end: int) -> torch.Tensor:
            if as_mask:
                return chosen[a:b, :end]
            picked = torch.zeros(b - a, S, dtype=torch.bool).scatter_(1, chosen[a:b], True)[:, :end]
            return picked & causal_mask(b - a, end, pos + a)

        return self.attend(q_nope, q_pe, latents, keys, pos, cache.query_chunk, mask_of)

    def attend_chosen(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, keys: torch.Tensor,
                      chosen: torch.Tensor, pos: int, query_chunk: int) -> torch.Tensor:  # fmt: skip
        """Each prompt query over its own top_k rows alone (those past it dropped), in position order, as a decode
        step reads them: the attention work of top_k keys a query, not of every earlier one under a mask. The
        up-projections are batched matmuls over a chunk of queries; the attention one C call. [T, H * v]."""
        cfg = self.cfg
        T = q_nope.shape[0]
        out = torch.empty(T, cfg.n_heads, cfg.v_head_dim)
        up = self.up.widened()
        for a, b in query_chunks(T, query_chunk):
            rows = chosen[a:b].sort(dim=1).values
            counts = (rows <= torch.arange(pos + a, pos + b)[:, None]).sum(1)
            q_lat = up.absorb(q_nope[a:b])  # [n, H, L]
            o_lat = kernels.mla_sparse(q_lat, q_pe[a:b], latents, keys, rows, counts, cfg.kq_scale)
            out[a:b] = up.values(o_lat)
        return out.reshape(T, -1)

    def choose(self, parts: tuple[torch.Tensor, ...], layer: int, cache: DSACache, pos: int,
               rope: RoPE) -> torch.Tensor | None:  # fmt: skip
        """Stores the span's indexer keys; returns the keys each query attends to ([T, top_k] positions, the
        top ones by score, in ascending order for a decode step: where a query sees fewer, some are past it
        and the causal mask drops them), or None when no query sees more than top_k keys."""
        ix = self.cfg.indexer
        q, k, w = parts[3:6]
        T = q.shape[0]
        k = F.layer_norm(k, (ix.head_dim,), self.index_norm, self.index_norm_bias, INDEX_NORM_EPS)
        index_keys = cache.store_index_keys(layer, pos, self._rotated(k[:, None], pos, rope)[:, 0])
        if index_keys.shape[0] <= ix.top_k:
            return None
        q = self._rotated(q.reshape(T, ix.heads, ix.head_dim), pos, rope)
        scores = index_scores(q, index_keys, w * ix.heads**-0.5, pos, ix.head_dim**-0.5)
        if T > 1:
            return scores.topk(ix.top_k, dim=-1).indices
        # a decode step: the positions in ascending order, the order its attention reads the rows in
        if kernels.available():
            return kernels.topk_positions(scores[0], ix.top_k)[None]
        return scores.topk(ix.top_k, dim=-1).indices.sort(dim=-1).values

    def _rotated(self, x: torch.Tensor, pos: int, rope: RoPE) -> torch.Tensor:
        """x [T, heads, head_dim] with its first qk_rope dims rotated at positions pos.."""
        return rope(x if self.index_perm is None else x[..., self.index_perm], pos)
