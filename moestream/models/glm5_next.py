"""GLM-5.3-Flash (GGUF arch `glm5-next`; transformers' glm5_next, its text part): GLM-5's MoE (glm_dsa.py:
leading dense blocks, sigmoid routing with a correction bias, routed scale, a shared expert) on a different
trunk:
  - a hybrid schedule (attention.head_count_kv 0 for a linear block): Kimi Delta Attention (kda.py) in three
    blocks of four, latent attention with DeepSeek Sparse Attention (sparse_attention.py) in the fourth;
  - the latent attention has no rotary dims at all (NoPE: rope.dimension_count 0), nor has its indexer;
  - the indexer scores pools, not tokens: each run of `kpool` (attention.indexer.kpool, 16) positions from 0
    has one key, the softmax-weighted sum of its tokens' keys, weighted per channel by
    softmax_j(indexer_compressor_gate(x_j) + indexer_compressor_ape[j]); a query chooses its
    top_k / kpool best pools among those that end at or before it, and (kpool_select_tail) always the
    tokens of its own incomplete pool besides; while it sees no more pools than that, it sees every token;
  - "shared" attention blocks (attention.indexer.types) reuse the last full block's choice;
  - hyper-connected residual streams (hyper.py, DeepSeek-V4's mHC) whose head is the streams' plain mean;
  - routed experts, the shared one and the leading dense blocks' SwiGLUs all clipped at swiglu_clamp_*.
The converter's next-n (MTP) block after the trunk is never loaded: the load summary says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moestream.models.deepseek32 import DeepSeek32, DeepSeek32Config
from moestream.models.deltanet import HybridCache
from moestream.models.hyper import HyperDecoderLayer, HyperResidual, HyperSpec, hyper_block, stream_mean
from moestream.models.kda import KdaShape, KimiDeltaAttention
from moestream.models.kv_cache import as_cached
from moestream.models.layer import Mixer
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import DeltaNetMemory, LatentAttentionMemory, ModelMemory, MoEMemory
from moestream.models.mla import MLACache
from moestream.models.moe import ClippedMoE, DenseFFN
from moestream.models.sparse_attention import INDEX_NORM_EPS, SparseMLAttention, index_scores, indexer_config

ARCH = "glm5-next"


@dataclass
class Glm5NextConfig(DeepSeek32Config):
    kda: KdaShape | None = None
    kpool: int = 16
    select_tail: bool = True
    hc_mult: int = 4
    hc_iters: int = 20
    hc_eps: float = 1e-6
    clamp_exp: tuple[float, ...] = ()
    clamp_shexp: tuple[float, ...] = ()

    ARCH: ClassVar[str] = ARCH
    GATING_DEFAULT: ClassVar[int] = 2  # sigmoid: the converter writes no expert_gating_func
    MIN_ROPE: ClassVar[int] = 0

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> Glm5NextConfig:
        m = ArchMetadata(md, cls.ARCH, shapes, source)
        f = cls.fields(m)
        n = f["n_blocks"]
        kv_heads = m.per_block("attention.head_count_kv", n, int)
        recurrent = tuple(h == 0 for h in kv_heads)
        m.require(not all(recurrent), "attention.head_count_kv", "makes every block a linear one")
        f["q_lora_rank"] = m.int("attention.q_lora_rank")  # block 0 is linear: its tensors do not say
        m.require(f["qk_rope"] == 0, "rope.dimension_count", f"is {f['qk_rope']}; GLM-5.3-Flash attends without rope")
        ix = indexer_config(m, n, 0, f["q_lora_rank"], interleaved=False, default_full=[True] * n,
                            attends=[not r for r in recurrent])  # fmt: skip
        kpool = m.int("attention.indexer.kpool")
        m.require(kpool > 1 and ix.top_k % kpool == 0, "attention.indexer.kpool",
                  f"({kpool}) must divide the index top_k ({ix.top_k})")  # fmt: skip
        hidden, heads = f["hidden"], f["n_heads"]
        head_dim = m.int("kda.head_dim")
        lower = md.get(f"{ARCH}.kda.gate_lower_bound")
        m.require(lower is None or type(lower) in (int, float) and math.isfinite(lower) and lower < 0,
                  "kda.gate_lower_bound", f"is {lower!r}; it must be a finite negative number")  # fmt: skip
        kda = KdaShape(hidden, recurrent, heads, head_dim, m.int("ssm.conv_kernel"), lower, f["rms_eps"])
        clamp = m.per_block("swiglu_clamp_exp", n, float)
        shclamp = m.per_block("swiglu_clamp_shexp", n, float) if f"{ARCH}.swiglu_clamp_shexp" in md else clamp
        return cls(**f, indexer=ix, nextn=m.int("nextn_predict_layers", 0, low=0), kda=kda, kpool=kpool,
                   select_tail=m.flag("attention.indexer.kpool_select_tail", True),
                   hc_mult=m.int("hyper_connection.count"), hc_iters=m.int("hyper_connection.sinkhorn_iterations"),
                   hc_eps=m.float("hyper_connection.epsilon"), clamp_exp=tuple(clamp),
                   clamp_shexp=tuple(shclamp))  # fmt: skip

    @property
    def n_attention(self) -> int:
        assert self.kda is not None
        return len(self.kda.recurrent) - sum(self.kda.recurrent)


@dataclass(frozen=True)
class PooledAttentionMemory(LatentAttentionMemory):
    """LatentAttentionMemory with the pooled indexer's choice held as a [tokens, ctx] mask of bools."""

    def span_nbytes(self, tokens: int, ctx: int, chunk: int | None = None) -> int:
        return super().span_nbytes(tokens, ctx, chunk) + tokens * ctx


class KdaLatentCache(HybridCache):
    """One sequence's cache: the KDA blocks' recurrent states with their checkpoints (HybridCache), the
    attention blocks' latents (MLACache's update), and each full block's indexer keys and pool gates per token
    (the pools' keys are made from them where they are scored)."""

    def __init__(self, cfg: Glm5NextConfig, ctx: int, dtype: torch.dtype):
        assert cfg.kda is not None and cfg.indexer is not None
        super().__init__(cfg.kda, ctx, dtype)
        attends = [not r for r in cfg.kda.recurrent]
        self.latent = [torch.zeros(ctx, cfg.kv_lora_rank, dtype=dtype) if a else None for a in attends]
        self.rope = [torch.zeros(ctx, 0, dtype=dtype) if a else None for a in attends]  # NoPE: no rotary keys
        D = cfg.indexer.head_dim
        self.index_keys = [torch.zeros(ctx, D, dtype=dtype) if f else None for f in cfg.indexer.full]
        self.index_gates = [torch.zeros(ctx, D, dtype=dtype) if f else None for f in cfg.indexer.full]
        self.chosen: dict[int, torch.Tensor | None] = {}  # this step's choice, by a query chunk's first position
        self.keys_attended = [0] * len(attends)

    update = MLACache.update

    def _own(self) -> list[torch.Tensor]:
        return [t for t in self.latent + self.rope + self.index_keys + self.index_gates if t is not None]

    def rows(self) -> list[torch.Tensor]:
        return super().rows() + self._own()

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.numel() * t.element_size() for t in self._own())

    def begin_step(self, pos: int, n: int) -> None:
        super().begin_step(pos, n)
        self.chosen.clear()

    def store_index(self, layer: int, pos: int, k: torch.Tensor, gate: torch.Tensor):
        """Store positions pos..'s indexer keys and pool gates; returns every position's ([S, D], [S, D])."""
        keys, gates = self.index_keys[layer], self.index_gates[layer]
        assert keys is not None and gates is not None
        end = pos + k.shape[0]
        keys[pos:end], gates[pos:end] = as_cached(k, self.dtype), as_cached(gate, self.dtype)
        return keys[:end], gates[:end]


class PooledSparseAttention(SparseMLAttention):
    """GLM-5.3-Flash's attention block: latent attention without rotary dims over the tokens of the pools its
    indexer chooses (and the query's own incomplete pool)."""

    def __init__(self, w: Weights, i: int, cfg: Glm5NextConfig):
        super().__init__(w, i, cfg)
        if self.full:
            assert cfg.indexer is not None
            self.pool_ape = w.matrix(f"blk.{i}.indexer_compressor_ape.weight", cfg.kpool, cfg.indexer.head_dim)

    @staticmethod
    def index_inputs(i: int, cfg: Any) -> list[tuple[str, int, int]]:
        """The indexer's key, head weights and pool gates of the block's input."""
        gate = (f"blk.{i}.indexer_compressor_gate.weight", cfg.indexer.head_dim, cfg.hidden)
        return [*SparseMLAttention.index_inputs(i, cfg), gate]

    def rotate_and_store(self, parts: tuple[torch.Tensor, ...], layer: int, cache: KdaLatentCache, pos: int,
                         rope: Any) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """(q [T, H, nope], an empty rotary query, every position's latents and empty rotary keys)."""
        cfg = self.cfg
        q, kv, c = parts[:3]
        T = q.shape[0]
        latents, keys = cache.update(layer, pos, c, kv[:, cfg.kv_lora_rank :])
        q = q.reshape(T, cfg.n_heads, cfg.qk_nope)
        return q, q[..., :0], latents, keys

    def choose(self, parts: tuple[torch.Tensor, ...], layer: int, cache: KdaLatentCache, pos: int,
               rope: Any) -> torch.Tensor | None:  # fmt: skip
        """Stores the span's indexer keys and gates; returns the keys each query attends to ([T, S] mask), or
        None when every query sees every earlier token (no more complete pools than it may choose)."""
        cfg = self.cfg
        ix, P = cfg.indexer, cfg.kpool
        q, k, w, gate = parts[3:7]
        T, D = q.shape[0], ix.head_dim
        k = F.layer_norm(k, (D,), self.index_norm, self.index_norm_bias, INDEX_NORM_EPS)
        keys, gates = cache.store_index(layer, pos, k, gate)
        S, budget = keys.shape[0], ix.top_k // P
        n_pools = S // P
        if n_pools <= budget and cfg.select_tail:
            return None
        members = (n_pools, P, D)
        weights = torch.softmax(gates[: n_pools * P].float().view(members) + self.pool_ape, dim=1)
        pooled = (weights * keys[: n_pools * P].float().view(members)).sum(dim=1)  # [n_pools, D]
        ends = torch.arange(n_pools) * P + P - 1  # a pool is seen from its last token on
        scores = index_scores(q.reshape(T, ix.heads, D), pooled, w * ix.heads**-0.5, pos, D**-0.5, key_pos=ends)
        top = scores.topk(min(budget, n_pools), dim=-1).indices  # [T, k] pools; unseen ones rank last
        qpos = torch.arange(pos, pos + T)
        seen = (ends[top] <= qpos[:, None]).repeat_interleave(P, dim=1)
        picked = torch.zeros(T, S, dtype=torch.bool)
        picked.scatter_(1, (top[..., None] * P + torch.arange(P)).flatten(1), seen)
        if cfg.select_tail:  # the tokens of the query's own incomplete pool
            s, start = torch.arange(S)[None, :], qpos + 1 - (qpos + 1) % P
            picked |= (s >= start[:, None]) & (s <= qpos[:, None])
        return picked


class Glm5Next(DeepSeek32):
    arch = ARCH
    Config = Glm5NextConfig

    def __init__(self, cfg: Glm5NextConfig, w: Weights):
        self.hc_spec = HyperSpec(cfg.hc_mult, cfg.hc_iters, cfg.hc_eps, cfg.rms_eps)
        super().__init__(cfg, w)
        self.residual = HyperResidual(cfg.hc_mult, stream_mean)

    def _block(self, w: Weights, i: int) -> HyperDecoderLayer:
        return hyper_block(w, i, self.cfg.hidden, self.hc_spec, self.mixer, self.ffn)

    def mixer(self, w: Weights, i: int) -> Mixer:  # type: ignore[override]
        cfg = self.cfg
        return KimiDeltaAttention(w, i, cfg.kda) if cfg.kda.recurrent[i] else PooledSparseAttention(w, i, cfg)

    def ffn(self, w: Weights, i: int) -> DenseFFN | ClippedMoE:  # type: ignore[override]
        c = self.cfg
        if i < c.first_moe_block:
            return DenseFFN(w, i, c.hidden, c.dense_ffn, limit=c.clamp_shexp[i])
        return ClippedMoE(w, i, hidden=c.hidden, n_experts=c.n_experts, expert_ffn=c.expert_ffn, top_k=c.top_k,
                          norm_topk=c.routing.norm, shared_ffn=c.shared_ffn, routing=c.routing,
                          expert_layer=i - c.first_moe_block, limit=c.clamp_exp[i],
                          shared_limit=c.clamp_shexp[i])  # fmt: skip

    def rotary(self, cfg: Glm5NextConfig) -> None:  # type: ignore[override]
        return None  # no block rotates anything

    @staticmethod
    def memory(cfg: Glm5NextConfig) -> ModelMemory:  # type: ignore[override]
        """What one sequence's latent, indexer and recurrent state and a prompt's compute hold (memory.py):
        the indexer caches a key and a pool gate of head_dim values a token in each full block."""
        ix, kda = cfg.indexer, cfg.kda
        assert ix is not None and kda is not None
        mla = PooledAttentionMemory(cfg.n_attention, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope,
                                    0, cfg.v_head_dim, ix.n_full, ix.heads, 2 * ix.head_dim,
                                    ix.top_k + cfg.kpool)  # fmt: skip
        linear = DeltaNetMemory(kda.conv_kernel, kda.conv_dim, kda.heads, kda.head_dim, kda.head_dim, kda.state_nbytes)
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn, always_on_ffn=max(cfg.shared_ffn, cfg.dense_ffn))
        return ModelMemory(cfg.hidden * cfg.hc_mult, cfg.vocab_size, (mla, linear), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> KdaLatentCache:  # type: ignore[override]
        return KdaLatentCache(self.cfg, ctx, dtype)

    @staticmethod
    def load_notes(cfg: Glm5NextConfig, exact: bool = False) -> list[str]:  # type: ignore[override]
        ix = cfg.indexer
        assert ix is not None
        n_attn = cfg.n_attention
        lines = [f"glm5-next blocks: {cfg.n_blocks - n_attn} Kimi Delta Attention (linear), {n_attn} latent "
                 f"attention without rope ({ix.n_full} with their own indexer, {n_attn - ix.n_full} sharing it), "
                 f"each query over the top {ix.top_k // cfg.kpool} pools of {cfg.kpool} tokens"]  # fmt: skip
        return lines + DeepSeek32.load_notes(cfg, exact)
