"""DeepSeek-V2/V2-Lite/V3/R1 and Kimi-K2 (GGUF arch `deepseek2`).

Decoder layer: x += MLA(RMSNorm(x)); x += FFN(RMSNorm(x)), where the FFN of the first
leading_dense_block_count blocks is a dense SwiGLU and of the others a MoE: routed SwiGLU experts (streamed)
plus always-on shared experts (one SwiGLU of n_shared x the expert size).
Attention: multi-head latent attention (mla.py), with YaRN rotary scaling where the file sets it.
Routing (moe.Routing): softmax (V2) or sigmoid (V3, Kimi-K2) scores; V3's correction bias
(`exp_probs_b.bias`) added for the choice only; the top-k taken within the best expert_group_used_count of
expert_group_count groups; the k weights renormalised (expert_weights_norm) and scaled
(expert_weights_scale).

The engine numbers only the MoE layers (expert layer L is block leading_dense_block_count + L), so
cfg.n_layers counts those; cfg.n_blocks counts every block the model runs. Multi-token-prediction blocks
a file may carry after the trunk (nextn_predict_layers) are never loaded.

YaRN as llama.cpp applies it to these files: the file stores rope.scaling.yarn_log_multiplier as 0.1 x
mscale_all_dim; the rotation keeps unit magnitude (the config's mscale equals its mscale_all_dim), and
softmax's scale becomes mscale^2 / sqrt(qk head size) with mscale = 1 + 0.1 mscale_all_dim ln(factor).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moestream.models.base import MoEModel
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import LatentAttentionMemory, ModelMemory, MoEMemory
from moestream.models.mla import MLACache, MLAttention
from moestream.models.moe import DenseFFN, MoE, dense_or_moe
from moestream.models.rope import RoPE, yarn_inv_freq
from moestream.models.routing import Routing

ARCH = "deepseek2"
GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values


@dataclass
class DeepSeek2Config:
    n_layers: int  # MoE layers: what the expert cache and route traces number
    n_blocks: int  # every block of the trunk
    first_moe_block: int  # leading dense blocks before the first MoE one
    hidden: int
    n_heads: int
    q_lora_rank: int  # 0: the query is one projection (V2-Lite)
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    dense_ffn: int
    vocab_size: int
    context_length: int
    routing: Routing
    rope_theta: float = 10_000.0
    rope_inv_freq: tuple[float, ...] = ()  # YaRN's frequencies; empty: plain theta^(-2i/d)
    rope_mscale: float = 1.0
    kq_scale: float = 0.0
    rms_eps: float = 1e-6

    ARCH: ClassVar[str] = ARCH  # the metadata's key prefix (the files of DeepSeek's descendants use their own)
    GATING_DEFAULT: ClassVar[int] = 1  # expert_gating_func where a file has none
    MIN_ROPE: ClassVar[int] = 1  # the fewest rotary dims a file may have (GLM-5.3-Flash's attention has none)

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> DeepSeek2Config:
        return cls(**cls.fields(ArchMetadata(md, cls.ARCH, shapes, source)))

    @classmethod
    def fields(cls, m: ArchMetadata) -> dict[str, Any]:
        """The config's fields from a file's metadata (m: its keys under the architecture's prefix)."""
        md, shapes = m.md, m.shapes
        blocks = m.int("block_count")
        nextn = m.int("nextn_predict_layers", 0, low=0)
        n_blocks = blocks - nextn
        n_dense = m.int("leading_dense_block_count", 0, low=0)
        m.require(n_dense < n_blocks, "leading_dense_block_count",
                  f"is {n_dense} of {n_blocks} blocks; there would be no MoE layer")  # fmt: skip
        hidden, n_heads = m.int("embedding_length"), m.int("attention.head_count", per_layer=True)
        kv_lora, rope_dim = m.int("attention.kv_lora_rank"), m.int("rope.dimension_count", low=cls.MIN_ROPE)
        m.require(rope_dim % 2 == 0, "rope.dimension_count", f"is {rope_dim}; rotary embedding needs it even")
        if f"{m.arch}.attention.key_length_mla" in md:  # the converter's MLA form: keys are [latent | rope]
            qk, v = m.int("attention.key_length_mla"), m.int("attention.value_length_mla")
            key = m.int("attention.key_length", kv_lora + rope_dim)
            m.require(key == kv_lora + rope_dim, "attention.key_length",
                      f"is {key}, not kv_lora_rank + rope.dimension_count = {kv_lora + rope_dim}")  # fmt: skip
        else:
            qk, v = m.int("attention.key_length"), m.int("attention.value_length")
        m.require(qk > rope_dim, "attention.key_length", f"({qk}) leaves no room for {rope_dim} rotary dims")
        n_experts, top_k = m.experts()
        expert_ffn = m.int("expert_feed_forward_length", per_layer=True)
        shexp = f"blk.{n_dense}.ffn_gate_shexp.weight"
        n_shared = m.int("expert_shared_count", 0, low=0)
        shared_ffn = m.tensor_shape(shexp)[0] if shexp in shapes else n_shared * expert_ffn
        dense_ffn = m.tensor_shape("blk.0.ffn_gate.weight")[0] if n_dense else 0
        return dict(
            n_layers=n_blocks - n_dense,
            n_blocks=n_blocks,
            first_moe_block=n_dense,
            hidden=hidden,
            n_heads=n_heads,
            q_lora_rank=m.int("attention.q_lora_rank", 0, low=0) if "blk.0.attn_q_a.weight" in shapes else 0,
            kv_lora_rank=kv_lora,
            qk_nope=qk - rope_dim,
            qk_rope=rope_dim,
            v_head_dim=v,
            n_experts=n_experts,
            top_k=top_k,
            expert_ffn=expert_ffn,
            shared_ffn=shared_ffn,
            dense_ffn=dense_ffn,
            vocab_size=m.tensor_shape("token_embd.weight")[0],
            context_length=m.int("context_length", 4096),
            routing=_routing(m, n_experts, top_k, cls.GATING_DEFAULT),
            rope_theta=m.float("rope.freq_base", 10_000.0),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6),
            **_rope_scaling(m, md, rope_dim, qk),
        )


def _routing(m: ArchMetadata, n_experts: int, top_k: int, default: int = 1) -> Routing:
    func = m.int("expert_gating_func", default)
    m.require(func in GATING, "expert_gating_func", f"is {func}; moestream runs 1 (softmax) and 2 (sigmoid)")
    n_group = m.int("expert_group_count", 1)
    topk_group = m.int("expert_group_used_count", n_group)
    if n_group > 1:
        m.require(n_experts % n_group == 0, "expert_group_count",
                  f"({n_group}) does not divide the {n_experts} experts")  # fmt: skip
        m.require(topk_group <= n_group and top_k <= topk_group * (n_experts // n_group),
                  "expert_group_used_count", f"({topk_group} of {n_group} groups) leaves fewer than "
                  f"{top_k} experts to choose from")  # fmt: skip
    scale = m.float("expert_weights_scale", 1.0)
    return Routing(
        gating=GATING[func],
        norm=m.flag("expert_weights_norm", False),
        scale=scale,
        n_group=n_group,
        topk_group=topk_group,
        # DeepSeek-V2's grouped softmax routing (group_limited_greedy) ranks groups by their best expert;
        # V3's sigmoid routing (noaux_tc) by the sum of their best two
        group_score="max" if GATING[func] == "softmax" else "top2",
    )


def _rope_scaling(m: ArchMetadata, md: Mapping[str, Any], rope_dim: int, qk: int) -> dict[str, Any]:
    kind = md.get(f"{m.arch}.rope.scaling.type", "none")
    factor = m.float("rope.scaling.factor", 1.0) if kind in ("yarn", "linear") else 1.0
    theta = m.float("rope.freq_base", 10_000.0)
    out: dict[str, Any] = {"kq_scale": 1.0 / math.sqrt(qk)}
    if factor <= 1.0:
        return out
    if kind == "linear":
        base = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
        return out | {"rope_inv_freq": tuple((base / factor).tolist())}
    orig = m.int("rope.scaling.original_context_length", m.int("context_length", 4096))
    inv = yarn_inv_freq(rope_dim, theta, factor, orig, m.float("rope.scaling.yarn_beta_fast", 32.0),
                        m.float("rope.scaling.yarn_beta_slow", 1.0))  # fmt: skip
    log_mul = md.get(f"{m.arch}.rope.scaling.yarn_log_multiplier", 0.0)
    if isinstance(log_mul, bool) or not isinstance(log_mul, (int, float)) or not math.isfinite(log_mul):
        raise m.error("rope.scaling.yarn_log_multiplier", f"is {log_mul!r}, not a finite number; the file is damaged")
    mscale_all_dim = log_mul / 0.1  # the converter stores 0.1 x mscale_all_dim
    # llama.cpp: with a log multiplier the rotation keeps unit magnitude; without, YaRN's own 1 + 0.1 ln(factor)
    rope_mscale = 1.0 if mscale_all_dim else 1.0 + 0.1 * math.log(factor)
    mscale = rope_mscale * (1.0 + 0.1 * mscale_all_dim * math.log(factor))
    return {"kq_scale": mscale * mscale / math.sqrt(qk), "rope_inv_freq": tuple(inv.tolist()),
            "rope_mscale": rope_mscale}  # fmt: skip


class DeepSeek2(MoEModel):
    arch = ARCH
    Config = DeepSeek2Config

    @staticmethod
    def n_blocks(cfg: DeepSeek2Config) -> int:
        return cfg.n_blocks

    def mixer(self, w: Weights, i: int) -> MLAttention:
        return MLAttention(w, i, self.cfg)

    def ffn(self, w: Weights, i: int) -> DenseFFN | MoE:
        return dense_or_moe(w, i, self.cfg)

    def rotary(self, cfg: DeepSeek2Config) -> RoPE:
        inv = torch.tensor(cfg.rope_inv_freq, dtype=torch.float64) if cfg.rope_inv_freq else None
        return RoPE(cfg.qk_rope, cfg.rope_theta, max_pos=min(cfg.context_length, 4096), inv_freq=inv,
                    mscale=cfg.rope_mscale)  # fmt: skip

    @staticmethod
    def memory(cfg: DeepSeek2Config) -> ModelMemory:
        """What one sequence's latent cache and a prompt's compute hold (models/memory.py)."""
        mla = LatentAttentionMemory(cfg.n_blocks, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope,
                                    cfg.qk_rope, cfg.v_head_dim)  # fmt: skip
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn, always_on_ffn=max(cfg.shared_ffn, cfg.dense_ffn))
        return ModelMemory(cfg.hidden, cfg.vocab_size, (mla,), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> MLACache:
        return MLACache(self.cfg.n_blocks, self.cfg.kv_lora_rank, self.cfg.qk_rope, ctx, dtype)
