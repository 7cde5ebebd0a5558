"""Mixtral 8x7B / 8x22B: GGUF arch `llama` with `llama.expert_count` > 0 (a llama file without experts is a
dense model: models/dense.py).

Decoder layer: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)) (gqa.py). Attention: grouped-query, no biases
(loaded where a file has them), RoPE over whole heads; the converter stores q/k rows in llama's rotary
layout, put back at load (gqa.unpermute_rows). MoE: softmax router over all experts, top-k, the k weights
renormalised to sum to 1 (llama.cpp always renormalises for llama), SwiGLU experts of
`llama.feed_forward_length` rows. The experts are merged `ffn_{gate,up,down}_exps` tensors, or in older
files one `ffn_{gate,up,down}.E` tensor per expert (the expert store reads either).

Sliding window: Mixtral's config.json may carry one (Mistral-7B's 4096), but llama.cpp's converter writes
none for llama-arch files and its llama graph attends over the whole context; moestream does the same, so
its output is llama.cpp's on the same file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moestream.errors import ModelFileError
from moestream.models.gqa import GQAMoEConfig, GQAMoEModel, attention_fields
from moestream.models.loader import ArchMetadata

ARCH = "llama"


class MixtralConfig(GQAMoEConfig):
    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> MixtralConfig:
        m = ArchMetadata(md, ARCH, shapes, source)
        if not m.int("expert_count", 0, low=0):
            raise ModelFileError(
                f"{source}: a dense llama model (no {ARCH}.expert_count), not Mixtral; models.model_class "
                "opens it as dense.Llama"
            )
        ffn_key = "expert_feed_forward_length" if f"{ARCH}.expert_feed_forward_length" in md else "feed_forward_length"
        return cls(
            **attention_fields(m),
            expert_ffn=m.int(ffn_key, per_layer=True),
            norm_topk_prob=True,
        )


class Mixtral(GQAMoEModel):
    arch = ARCH
    Config = MixtralConfig
    rope_pairs = True
