"""Dense decoders, every weight resident and nothing to stream: GGUF arch `llama` without experts (Llama,
SmolLM2), `qwen2` (Qwen2, Qwen2.5) and `qwen3` (Qwen3's dense models).

Decoder layer: x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)), the FFN `<arch>.feed_forward_length` rows
wide (moe.DenseFFN). Attention: grouped-query, NeoX-style RoPE over whole heads once the rows are in
transformers' order. llama: q/k rows permuted by the converter, put back at load (gqa.unpermute_rows), biases
where a file has them. qwen2: q/k/v biases (gqa.GQAttention loads them). qwen3: RMSNorm on each head of q
and k (qwen3moe's attention, its fused decode kernel included), no biases.

The config says the model has no routed experts (n_layers, n_experts and top_k 0; n_blocks counts the
blocks), so the expert store, the cache and the planner are those of every other model, empty: the budget
plan names no expert slots and nothing is ever read after loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moestream.models.base import MoEModel
from moestream.models.gqa import GQAttention, attention_fields
from moestream.models.kv_cache import KVCache
from moestream.models.layer import Mixer
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import AttentionMemory, ModelMemory, MoEMemory
from moestream.models.moe import DenseFFN
from moestream.models.qwen3moe import Attention as HeadNormAttention
from moestream.models.rope import RoPE


@dataclass
class DenseConfig:
    n_blocks: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    context_length: int
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6
    # what the expert cache and route traces number: nothing
    n_layers: int = 0
    n_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0

    ARCH = ""  # the GGUF architecture whose keys the config reads (a subclass sets it)

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> DenseConfig:
        m = ArchMetadata(md, cls.ARCH, shapes, source)
        if m.int("expert_count", 0, low=0):
            raise m.error("expert_count", "is set; a model with routed experts is not a dense one")
        fields = attention_fields(m, experts=False)
        fields["n_blocks"] = fields.pop("n_layers")
        return cls(**fields, ffn=m.int("feed_forward_length", per_layer=True))


class LlamaConfig(DenseConfig):
    ARCH = "llama"


class Qwen2Config(DenseConfig):
    ARCH = "qwen2"


class Qwen3Config(DenseConfig):
    ARCH = "qwen3"


class DenseModel(MoEModel):
    """A dense architecture: a subclass sets arch, Config and its attention."""

    @staticmethod
    def n_blocks(cfg: DenseConfig) -> int:
        return cfg.n_blocks

    def ffn(self, w: Weights, i: int) -> DenseFFN:
        return DenseFFN(w, i, self.cfg.hidden, self.cfg.ffn)

    def rotary(self, cfg: DenseConfig) -> RoPE:
        return RoPE(cfg.head_dim, cfg.rope_theta, max_pos=min(cfg.context_length, 4096))

    @staticmethod
    def memory(cfg: DenseConfig) -> ModelMemory:
        """What one sequence's KV cache and a prompt's compute hold (models/memory.py): the FFN is the
        always-on one, with no routed expert beside it."""
        attention = AttentionMemory(cfg.n_blocks, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        return ModelMemory(cfg.hidden, cfg.vocab_size, (attention,), MoEMemory(0, 0, 0, always_on_ffn=cfg.ffn))

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> KVCache:
        return KVCache([self.cfg.n_kv_heads] * self.cfg.n_blocks, self.cfg.head_dim, ctx, dtype)


class Llama(DenseModel):
    arch = "llama"
    Config = LlamaConfig

    def mixer(self, w: Weights, i: int) -> Mixer:
        return GQAttention(w, i, self.cfg, rope_pairs=True)


class Qwen2(DenseModel):
    arch = "qwen2"
    Config = Qwen2Config

    def mixer(self, w: Weights, i: int) -> Mixer:
        return GQAttention(w, i, self.cfg)


class Qwen3(DenseModel):
    arch = "qwen3"
    Config = Qwen3Config

    def mixer(self, w: Weights, i: int) -> Mixer:
        return HeadNormAttention(w, i, self.cfg)
