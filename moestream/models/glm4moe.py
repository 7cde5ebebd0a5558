"""GLM-4.5, GLM-4.5-Air and GLM-4.6 (GGUF arch `glm4moe`).

Decoder layer: x += Attn(RMSNorm(x)); x += FFN(RMSNorm(x)); the second norm is the file's
`post_attention_norm`. The FFN of the first leading_dense_block_count blocks is a dense SwiGLU, of the others
a MoE: routed SwiGLU experts (streamed) plus an always-on shared expert.
Attention: grouped-query with biases on q, k and v, an optional RMSNorm on each head of q and k (GLM-4.5,
not Air), NeoX-style rotary embedding on the first rope.dimension_count dims of each head only (half of it:
the converter neither permutes q/k nor writes the rest rotated).
Routing (moe.Routing): sigmoid scores, the correction bias (`exp_probs_b.bias`) added for the choice only,
the top-k optionally within the best expert_group_used_count of expert_group_count groups, the k weights
renormalised (expert_weights_norm) and scaled (expert_weights_scale, the routed scaling factor).

The engine numbers only the MoE layers (expert layer L is block leading_dense_block_count + L), so
cfg.n_layers counts those; cfg.n_blocks counts every block the model runs. The converter appends
nextn_predict_layers multi-token-prediction blocks (a whole MoE block plus eh_proj, enorm, hnorm, ...);
block_count includes them, and they are never loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moestream.compute import linear
from moestream.models.base import MoEModel
from moestream.models.kv_cache import KVCache
from moestream.models.layer import SplitMixer
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import AttentionMemory, ModelMemory, MoEMemory
from moestream.models.moe import DenseFFN, MoE, dense_or_moe
from moestream.models.ops import rms_norm
from moestream.models.rope import RoPE
from moestream.models.routing import Routing
from moestream.models.rows import Ops

ARCH = "glm4moe"
# llama.cpp's expert_gating_func values; a file without one (0) is sigmoid-gated for this architecture
GATING = {0: "sigmoid", 1: "softmax", 2: "sigmoid"}


@dataclass
class Glm4MoeConfig:
    n_layers: int  # MoE layers: what the expert cache and route traces number
    n_blocks: int  # every block of the trunk (without the MTP blocks)
    first_moe_block: int  # leading dense blocks before the first MoE one
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int  # the rotated dims at the start of each head
    n_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    dense_ffn: int
    vocab_size: int
    context_length: int
    routing: Routing
    rope_theta: float = 10_000.0
    rope_scale: float = 1.0  # linear rope scaling: frequencies divided by this
    rms_eps: float = 1e-5

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> Glm4MoeConfig:
        m = ArchMetadata(md, ARCH, shapes, source)
        blocks = m.int("block_count")
        nextn = m.int("nextn_predict_layers", 0, low=0)
        m.require(nextn < blocks, "nextn_predict_layers", f"is {nextn} of {blocks} blocks; the trunk would be empty")
        n_blocks = blocks - nextn
        n_dense = m.int("leading_dense_block_count", 0, low=0)
        m.require(n_dense < n_blocks, "leading_dense_block_count",
                  f"is {n_dense} of {n_blocks} blocks; there would be no MoE layer")  # fmt: skip
        hidden, n_heads, n_kv_heads, head_dim = m.attention()
        value = m.int("attention.value_length", head_dim)
        m.require(value == head_dim, "attention.value_length", f"is {value}, not the key length {head_dim}")
        rope_dim = m.int("rope.dimension_count", head_dim)
        m.require(rope_dim % 2 == 0 and rope_dim <= head_dim, "rope.dimension_count",
                  f"is {rope_dim}; it must be even and at most the head size {head_dim}")  # fmt: skip
        n_experts, top_k = m.experts()
        expert_ffn = m.int("expert_feed_forward_length", per_layer=True)
        shexp = f"blk.{n_dense}.ffn_gate_shexp.weight"
        n_shared = m.int("expert_shared_count", 0, low=0)
        shared_ffn = m.tensor_shape(shexp)[0] if shexp in shapes else n_shared * expert_ffn
        return cls(
            n_layers=n_blocks - n_dense,
            n_blocks=n_blocks,
            first_moe_block=n_dense,
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rope_dim=rope_dim,
            n_experts=n_experts,
            top_k=top_k,
            expert_ffn=expert_ffn,
            shared_ffn=shared_ffn,
            dense_ffn=m.tensor_shape("blk.0.ffn_gate.weight")[0] if n_dense else 0,
            vocab_size=m.tensor_shape("token_embd.weight")[0],
            context_length=m.int("context_length", 4096),
            routing=_routing(m, n_experts, top_k),
            rope_theta=m.float("rope.freq_base", 10_000.0),
            rope_scale=_rope_scale(m, md),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-5),
        )


def _routing(m: ArchMetadata, n_experts: int, top_k: int) -> Routing:
    func = m.int("expert_gating_func", 2, low=0)
    m.require(func in GATING, "expert_gating_func", f"is {func}; moestream runs 1 (softmax) and 2 (sigmoid)")
    n_group = m.int("expert_group_count", 1)
    topk_group = m.int("expert_group_used_count", n_group)
    if n_group > 1:
        m.require(n_experts % n_group == 0, "expert_group_count",
                  f"({n_group}) does not divide the {n_experts} experts")  # fmt: skip
        m.require(topk_group <= n_group and top_k <= topk_group * (n_experts // n_group),
                  "expert_group_used_count", f"({topk_group} of {n_group} groups) leaves fewer than "
                  f"{top_k} experts to choose from")  # fmt: skip
    return Routing(
        gating=GATING[func],
        norm=m.flag("expert_weights_norm", False),
        scale=m.float("expert_weights_scale", 1.0),
        n_group=n_group,
        topk_group=topk_group,
        group_score="top2",  # GLM's noaux_tc router ranks groups by the sum of their best two scores
    )


def _rope_scale(m: ArchMetadata, md: Mapping[str, Any]) -> float:
    kind = md.get(f"{ARCH}.rope.scaling.type", "none")
    if kind == "none":
        return 1.0
    factor = m.float("rope.scaling.factor", 1.0)
    m.require(kind == "linear" or factor == 1.0, "rope.scaling.type",
              f"is {kind!r}; moestream runs glm4moe files with linear rope scaling or none")  # fmt: skip
    return factor


class Attention(SplitMixer):
    def __init__(self, w: Weights, i: int, cfg: Glm4MoeConfig):
        p = f"blk.{i}."
        H, D = cfg.hidden, cfg.head_dim
        sizes = [cfg.n_heads * D, cfg.n_kv_heads * D, cfg.n_kv_heads * D]
        names = ("attn_q", "attn_k", "attn_v")
        parts = [w.linear(f"{p}{n}.weight", size, H) for n, size in zip(names, sizes, strict=True)]
        self.qkv = linear.concat(parts)  # one matmul instead of three when the forms agree
        self.parts = None if self.qkv is not None else parts
        self.sizes = sizes
        # one bias vector over [q | k | v]; a projection without a bias adds zeros
        biases = [w.vector(f"{p}{n}.bias", size) if w.has(f"{p}{n}.bias") else torch.zeros(size)
                  for n, size in zip(names, sizes, strict=True)]  # fmt: skip
        self.bias = torch.cat(biases) if any(w.has(f"{p}{n}.bias") for n in names) else None
        self.o = w.linear(p + "attn_output.weight", H, sizes[0])
        self.q_norm = w.vector(p + "attn_q_norm.weight", D) if w.has(p + "attn_q_norm.weight") else None
        self.k_norm = w.vector(p + "attn_k_norm.weight", D) if w.has(p + "attn_k_norm.weight") else None
        self.cfg = cfg

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor]:
        qkv = ops.mm(self.qkv, x) if self.qkv is not None else torch.cat([ops.mm(lin, x) for lin in self.parts], dim=-1)
        return (qkv if self.bias is None else qkv + self.bias,)

    def core(self, parts: tuple[torch.Tensor], layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        cfg = self.cfg
        (qkv,) = parts
        T = qkv.shape[0]
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.reshape(T, cfg.n_heads, cfg.head_dim)
        k = k.reshape(T, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.n_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_eps)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, cfg.rms_eps)
        keys, values = kv.update(layer, pos, rope(k, pos), v)
        out = kv.attend(rope(q, pos), keys, values, pos)
        return out.reshape(T, cfg.n_heads * cfg.head_dim)

    def output(self, a: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.mm(self.o, a)


class Glm4Moe(MoEModel):
    arch = ARCH
    Config = Glm4MoeConfig

    ffn_norm = "post_attention_norm"

    @staticmethod
    def n_blocks(cfg: Glm4MoeConfig) -> int:
        return cfg.n_blocks

    def mixer(self, w: Weights, i: int) -> Attention:
        return Attention(w, i, self.cfg)

    def ffn(self, w: Weights, i: int) -> DenseFFN | MoE:
        return dense_or_moe(w, i, self.cfg)

    def rotary(self, cfg: Glm4MoeConfig) -> RoPE:
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64) / cfg.rope_dim))
        return RoPE(cfg.head_dim, cfg.rope_theta, cfg.rope_dim, max_pos=min(cfg.context_length, 4096),
                    inv_freq=inv / cfg.rope_scale)  # fmt: skip

    @staticmethod
    def memory(cfg: Glm4MoeConfig) -> ModelMemory:
        """What one sequence's KV cache and a prompt's compute hold (models/memory.py)."""
        attention = AttentionMemory(cfg.n_blocks, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn, always_on_ffn=max(cfg.shared_ffn, cfg.dense_ffn))
        return ModelMemory(cfg.hidden, cfg.vocab_size, (attention,), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> KVCache:
        return KVCache([self.cfg.n_kv_heads] * self.cfg.n_blocks, self.cfg.head_dim, ctx, dtype)
