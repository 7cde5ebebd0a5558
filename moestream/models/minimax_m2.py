"""MiniMax-M2 (GGUF arch `minimax-m2`, transformers `minimax_m2`).

Decoder layer: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)) (gqa.py), every block a MoE block.
Attention: grouped-query without biases, an RMSNorm over the whole q projection and the whole k projection
(one weight of n_heads x head_dim across the heads, as OLMoE's, not per head) before NeoX-style RoPE on the
first rope.dimension_count dims of each head only (the checkpoints' rotary_dim: 64 of 128).
MoE: sigmoid scores, the correction bias (`exp_probs_b.bias`) added for the choice only, the k weights of the
unbiased scores renormalised to sum to 1 (llama.cpp's minimax-m2 graph always renormalises), SwiGLU experts
of expert_feed_forward_length rows, no shared expert.

The checkpoints carry multi-token-prediction modules (use_mtp, num_mtp_modules) that llama.cpp's converter
does not write: block_count is the trunk, so there is nothing to skip in a converted file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moestream.models.gqa import GQAMoEConfig, GQAMoEModel, attention_fields
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.moe import MoE
from moestream.models.routing import Routing

ARCH = "minimax-m2"
# llama.cpp's expert_gating_func values; the converter writes 2 from the config's scoring_func "sigmoid"
GATING = {1: "softmax", 2: "sigmoid"}


@dataclass
class MiniMaxM2Config(GQAMoEConfig):
    routing: Routing = Routing(gating="sigmoid", norm=True)

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> MiniMaxM2Config:
        m = ArchMetadata(md, ARCH, shapes, source)
        fields = attention_fields(m, 5_000_000.0, partial_rope=True)
        func = m.int("expert_gating_func", 2)
        m.require(func in GATING, "expert_gating_func", f"is {func}; moestream runs 1 (softmax) and 2 (sigmoid)")
        scale = m.md.get(f"{ARCH}.expert_weights_scale", 0.0) or 1.0  # llama.cpp: 0 (unset) scales by nothing
        ok = isinstance(scale, (int, float)) and scale > 0
        m.require(ok, "expert_weights_scale", f"is {scale!r}; it must be > 0")
        return cls(
            **fields,
            expert_ffn=m.int("expert_feed_forward_length", per_layer=True),
            norm_topk_prob=True,
            routing=Routing(gating=GATING[func], norm=True, scale=float(scale)),
        )


class MiniMaxM2(GQAMoEModel):
    arch = ARCH
    Config = MiniMaxM2Config
    qk_norm = True

    def ffn(self, w: Weights, i: int) -> MoE:
        cfg = self.cfg
        return MoE(w, i, hidden=cfg.hidden, n_experts=cfg.n_experts, expert_ffn=cfg.expert_ffn, top_k=cfg.top_k,
                   norm_topk=True, routing=cfg.routing)  # fmt: skip
