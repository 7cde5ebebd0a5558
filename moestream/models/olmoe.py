"""OLMoE (GGUF arch `olmoe`): OLMoE-1B-7B.

Decoder layer: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)) (gqa.py). Attention: grouped-query, RMSNorm
over the whole q projection and the whole k projection (one weight of n_heads x head_dim, not per head)
before NeoX-style RoPE, no biases. MoE: softmax router over all experts, top-k, the k weights NOT
renormalised (llama.cpp's olmoe graph never renormalises, as the checkpoints' norm_topk_prob = false),
SwiGLU experts of `olmoe.feed_forward_length` rows, no shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moestream.models.gqa import GQAMoEConfig, GQAMoEModel, attention_fields
from moestream.models.loader import ArchMetadata

ARCH = "olmoe"


class OlmoeConfig(GQAMoEConfig):
    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> OlmoeConfig:
        m = ArchMetadata(md, ARCH, shapes, source)
        return cls(**attention_fields(m), expert_ffn=m.int("feed_forward_length", per_layer=True))


class Olmoe(GQAMoEModel):
    arch = ARCH
    Config = OlmoeConfig
    qk_norm = True
