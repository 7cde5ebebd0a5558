"""Qwen2-MoE (GGUF arch `qwen2moe`): Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B.

Decoder layer: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)) (gqa.py). Attention: grouped-query with q/k/v
biases, NeoX-style RoPE, no q/k norm. MoE: softmax router over all experts, top-k, the k weights NOT
renormalised (llama.cpp's qwen2moe graph never does; the checkpoints set norm_topk_prob = false), SwiGLU
experts, plus one always-on shared expert scaled by its own sigmoid gate:
out = routed(x) + sigmoid(x . ffn_gate_inp_shexp) * shared(x).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moestream.models.gqa import GQAMoEConfig, GQAMoEModel, attention_fields
from moestream.models.loader import ArchMetadata

ARCH = "qwen2moe"


class Qwen2MoeConfig(GQAMoEConfig):
    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> Qwen2MoeConfig:
        m = ArchMetadata(md, ARCH, shapes, source)
        fields = attention_fields(m)
        # llama.cpp's fallbacks where the keys are missing: the whole FFN width split over the used experts,
        # and for the shared expert its tensor's own rows
        if f"{ARCH}.expert_feed_forward_length" in md:
            expert_ffn = m.int("expert_feed_forward_length", per_layer=True)
        else:
            expert_ffn = m.int("feed_forward_length", per_layer=True) // fields["top_k"]
        if f"{ARCH}.expert_shared_feed_forward_length" in md:
            shared_ffn = m.int("expert_shared_feed_forward_length")
        else:
            shared_ffn = m.tensor_shape("blk.0.ffn_gate_shexp.weight")[0]
        return cls(**fields, expert_ffn=expert_ffn, shared_ffn=shared_ffn, shared_gate=True)


class Qwen2Moe(GQAMoEModel):
    arch = ARCH
    Config = Qwen2MoeConfig
