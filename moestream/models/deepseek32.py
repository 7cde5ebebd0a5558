"""DeepSeek-V3.2 (GGUF arch `deepseek32`): DeepSeek-V3 (deepseek2.py: MLA, leading dense blocks, sigmoid
routing with a correction bias in groups, a shared expert) whose attention runs over the top_k tokens a
lightning indexer picks for each query (sparse_attention.py); every block has its own indexer, which
rotates its queries and keys in halves (NeoX style), unlike the attention's interleaved pairs.

The converter writes the indexer as blk.N.indexer.{attn_q_b, attn_k, k_norm (weight and bias), proj} and
the keys attention.indexer.{head_count, key_length, top_k}. The multi-token-prediction block it appends
(nextn_predict_layers) is never loaded: the engine says so when it opens the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moestream.models.deepseek2 import DeepSeek2, DeepSeek2Config
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import LatentAttentionMemory, ModelMemory, MoEMemory
from moestream.models.sparse_attention import DSACache, IndexerConfig, SparseMLAttention, indexer_config

ARCH = "deepseek32"


@dataclass
class DeepSeek32Config(DeepSeek2Config):
    indexer: IndexerConfig | None = None
    nextn: int = 0  # multi-token-prediction blocks in the file, not run

    ARCH: ClassVar[str] = ARCH
    GATING_DEFAULT: ClassVar[int] = 2  # sigmoid: DeepSeek-V3's router
    INTERLEAVED: ClassVar[bool] = False  # the indexer's rotary layout

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> DeepSeek32Config:
        m = ArchMetadata(md, cls.ARCH, shapes, source)
        f = cls.fields(m)
        n = f["n_blocks"]
        ix = indexer_config(m, n, f["qk_rope"], f["q_lora_rank"], interleaved=cls.INTERLEAVED,
                            default_full=cls.default_full(m, n))  # fmt: skip
        return cls(**f, indexer=ix, nextn=m.int("nextn_predict_layers", 0, low=0))

    @staticmethod
    def default_full(m: ArchMetadata, n_blocks: int) -> list[bool]:
        """Which blocks run their indexer where the file does not say: all of them."""
        return [True] * n_blocks


class DeepSeek32(DeepSeek2):
    arch = ARCH
    Config = DeepSeek32Config

    def mixer(self, w: Weights, i: int) -> SparseMLAttention:
        return SparseMLAttention(w, i, self.cfg)

    @staticmethod
    def memory(cfg: DeepSeek32Config) -> ModelMemory:
        """What one sequence's latent and indexer caches and a prompt's compute hold (models/memory.py)."""
        ix = cfg.indexer
        assert ix is not None
        mla = LatentAttentionMemory(cfg.n_blocks, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope,
                                    cfg.qk_rope, cfg.v_head_dim, ix.n_full, ix.heads, ix.head_dim,
                                    ix.top_k)  # fmt: skip
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn, always_on_ffn=max(cfg.shared_ffn, cfg.dense_ffn))
        return ModelMemory(cfg.hidden, cfg.vocab_size, (mla,), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> DSACache:
        c = self.cfg
        return DSACache(c.n_blocks, c.kv_lora_rank, c.qk_rope, ctx, dtype, c.indexer)

    @staticmethod
    def load_notes(cfg: DeepSeek32Config, exact: bool = False) -> list[str]:
        if not cfg.nextn:
            return []
        n = cfg.nextn
        return [f"the file's {n} multi-token-prediction (next-n) block(s) are skipped: moestream runs the trunk"]
