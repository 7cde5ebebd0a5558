"""GPT-OSS (GGUF arch `gpt-oss`): gpt-oss-20b and gpt-oss-120b, OpenAI's open-weight MoEs.

Decoder layer: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)); the second norm is the file's
`post_attention_norm`.
Attention: grouped-query with biases on q, k, v and the output, NeoX-style YaRN rotary embedding (the ramp's
ends not rounded to whole dims, as GPT-OSS's config sets `truncate: false`; cos and sin scaled by
0.1 ln(factor) + 1), and a learned logit per head (`attn_sinks`) that joins each softmax's denominator.
Even layers see only the last `sliding_window` positions; odd layers see every position.
MoE: the router has a bias; the top-k experts are chosen by logit and their weights are the softmax over
those k logits only. Each expert is a SwiGLU with biases on gate, up and down, gate clamped from above and up
from both sides at swiglu_limit, and down(g * sigmoid(alpha * g) * (u + 1)) (moe.ClampedSwiGLU).
The real files ship their experts in MXFP4, computed at their own 4 bits by the lane kernels (a group of
experts, biases and clamped activation included, in one native call: compute.linear.lane_swiglu); everything
else is resident.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moestream.compute import linear
from moestream.models.attention import attend_with_sinks
from moestream.models.base import MoEModel
from moestream.models.kv_cache import KVCache
from moestream.models.layer import SplitMixer
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import AttentionMemory, ModelMemory, MoEMemory
from moestream.models.moe import MoE
from moestream.models.rope import RoPE, yarn_inv_freq
from moestream.models.routing import Routing
from moestream.models.rows import Ops

ARCH = "gpt-oss"
# GPT-OSS's clamped SwiGLU; neither is written to the GGUF (llama.cpp hard-codes them too)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


@dataclass
class GptOssConfig:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    vocab_size: int
    context_length: int
    sliding_window: int  # the even layers' window (positions seen, the query's own included)
    rope_theta: float = 150_000.0
    rms_eps: float = 1e-5
    yarn_factor: float = 1.0  # 1: plain rotary embedding
    yarn_orig_ctx: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> GptOssConfig:
        m = ArchMetadata(md, ARCH, shapes, source)
        hidden, n_heads, n_kv_heads, head_dim = m.attention()
        m.require(head_dim % 2 == 0, "attention.key_length", f"is {head_dim}; rotary embedding needs it even")
        value = m.int("attention.value_length", head_dim)
        m.require(value == head_dim, "attention.value_length", f"is {value}, not the key length {head_dim}")
        n_experts, top_k = m.experts()
        kind = md.get(f"{ARCH}.rope.scaling.type", "none")
        m.require(kind in ("none", "yarn"), "rope.scaling.type", f"is {kind!r}; GPT-OSS files use yarn or none")
        yarn = kind == "yarn"
        return cls(
            n_layers=m.int("block_count"),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            n_experts=n_experts,
            top_k=top_k,
            expert_ffn=m.int("expert_feed_forward_length", per_layer=True),
            vocab_size=m.tensor_shape("token_embd.weight")[0],
            context_length=m.int("context_length", 4096),
            sliding_window=m.int("attention.sliding_window"),
            rope_theta=m.float("rope.freq_base", 150_000.0),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-5),
            yarn_factor=m.float("rope.scaling.factor", 1.0) if yarn else 1.0,
            yarn_orig_ctx=m.int("rope.scaling.original_context_length", 4096) if yarn else 4096,
            yarn_beta_fast=m.float("rope.scaling.yarn_beta_fast", 32.0),
            yarn_beta_slow=m.float("rope.scaling.yarn_beta_slow", 1.0),
        )

    def window(self, layer: int) -> int:
        """The layer's sliding window, or 0 where it sees every position (llama.cpp's swa pattern of 2)."""
        return self.sliding_window if layer % 2 == 0 else 0


class Attention(SplitMixer):
    def __init__(self, w: Weights, i: int, cfg: GptOssConfig):
        p = f"blk.{i}."
        H, D = cfg.hidden, cfg.head_dim
        sizes = [cfg.n_heads * D, cfg.n_kv_heads * D, cfg.n_kv_heads * D]
        names = ("attn_q", "attn_k", "attn_v")
        parts = [w.linear(f"{p}{n}.weight", size, H) for n, size in zip(names, sizes, strict=True)]
        self.qkv = linear.concat(parts)  # one matmul instead of three when the forms agree
        self.parts = None if self.qkv is not None else parts
        self.bias = torch.cat([w.vector(f"{p}{n}.bias", size) for n, size in zip(names, sizes, strict=True)])
        self.sizes = sizes
        self.o = w.linear(p + "attn_output.weight", H, sizes[0])
        self.o_bias = w.vector(p + "attn_output.bias", H)
        self.sinks = w.vector(p + "attn_sinks.weight", cfg.n_heads)
        self.window = cfg.window(i)
        self.cfg = cfg

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor]:
        qkv = ops.mm(self.qkv, x) if self.qkv is not None else torch.cat([ops.mm(lin, x) for lin in self.parts], dim=-1)
        return (qkv + self.bias,)

    def core(self, parts: tuple[torch.Tensor], layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        cfg = self.cfg
        (qkv,) = parts
        T = qkv.shape[0]
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.reshape(T, cfg.n_heads, cfg.head_dim)
        k = k.reshape(T, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.n_kv_heads, cfg.head_dim)
        keys, values = kv.update(layer, pos, rope(k, pos), v)
        out = attend_with_sinks(rope(q, pos), keys, values, pos, self.sinks, self.window)
        return out.reshape(T, cfg.n_heads * cfg.head_dim)

    def output(self, a: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.mm(self.o, a) + self.o_bias


def _rope(cfg: GptOssConfig) -> RoPE:
    max_pos = min(cfg.context_length, 4096)
    if cfg.yarn_factor == 1.0:
        return RoPE(cfg.head_dim, cfg.rope_theta, max_pos=max_pos)
    inv = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.yarn_factor, cfg.yarn_orig_ctx, cfg.yarn_beta_fast,
                        cfg.yarn_beta_slow, truncate=False)  # fmt: skip
    mscale = 0.1 * math.log(cfg.yarn_factor) + 1.0
    return RoPE(cfg.head_dim, cfg.rope_theta, max_pos=max_pos, inv_freq=inv, mscale=mscale)


class GptOss(MoEModel):
    arch = ARCH
    Config = GptOssConfig

    ffn_norm = "post_attention_norm"

    def mixer(self, w: Weights, i: int) -> Attention:
        return Attention(w, i, self.cfg)

    def ffn(self, w: Weights, i: int) -> MoE:
        cfg = self.cfg
        return MoE(w, i, hidden=cfg.hidden, n_experts=cfg.n_experts, expert_ffn=cfg.expert_ffn, top_k=cfg.top_k,
                   norm_topk=False, routing=Routing(gating="softmax_topk", norm=False),
                   clamped_swiglu=(SWIGLU_ALPHA, SWIGLU_LIMIT))  # fmt: skip

    def rotary(self, cfg: GptOssConfig) -> RoPE:
        return _rope(cfg)

    @staticmethod
    def memory(cfg: GptOssConfig) -> ModelMemory:
        """What one sequence's KV cache and a prompt's compute hold (models/memory.py)."""
        attention = AttentionMemory(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, sinks=True)
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn, clamped=True)
        return ModelMemory(cfg.hidden, cfg.vocab_size, (attention,), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> KVCache:
        return KVCache([self.cfg.n_kv_heads] * self.cfg.n_layers, self.cfg.head_dim, ctx, dtype)
