"""DeepSeek-V4 Flash and Pro (GGUF arch `deepseek4`).

Decoder layer over hyper-connected residual streams (hyper.py: hc_mult streams, Sinkhorn-mixed):
streams = HC(attention(RMSNorm(collapse(streams)))); streams = HC(MoE(RMSNorm(collapse(streams)))).
Attention (compressed_attention.py): one shared key/value head with q LoRA, a sliding window of raw entries,
and per the layer's compress rate (attention.compress_ratios) compressed entries: rate 4 with the lightning
indexer's top-k (CSA), rate 128 (HCA); a sink per head; a grouped output projection (o_groups groups of
heads each projected to o_lora_rank, then one projection to hidden). Sliding layers rotate with rope.freq_base;
compressed layers with attention.compress_rope_freq_base and the file's YaRN scaling (the rotation keeps
unit magnitude, as llama.cpp's and the reference's do).
MoE on every layer: sqrtsoftplus scores (sqrt(softplus(logit))), the top-k chosen on scores + the correction
bias (`exp_probs_b.bias`), the weights the chosen scores renormalised and scaled (expert_weights_scale); the
first hash_layer_count layers choose by token id instead (`ffn_gate_tid2eid`: the experts are known before
the layer runs). Routed and shared experts are SwiGLUs whose gate is clipped from above and up from both
sides (swiglu_clamp_exp / _shexp).
The multi-token-prediction block a file may carry after the trunk (nextn_predict_layers) is never loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moestream.models.base import MoEModel
from moestream.models.compressed_attention import (
    AttentionShape,
    CompressedAttention,
    CompressedKVCache,
    Rotary,
)
from moestream.models.hyper import HyperDecoderLayer, HyperHead, HyperResidual, HyperSpec, hyper_block
from moestream.models.layer import Step
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import CompressedAttentionMemory, ModelMemory, MoEMemory
from moestream.models.moe import ClippedMoE
from moestream.models.rope import yarn_inv_freq
from moestream.models.routing import Routing, route_general

ARCH = "deepseek4"
SQRT_SOFTPLUS = 4  # llama.cpp's expert_gating_func value
RATES = (0, 4, 128)  # the compress rates llama.cpp (and the checkpoints) have
SCHEDULE_NAMES = {0: "sliding", 4: "CSA 4:1", 128: "HCA 128:1"}


@dataclass
class DeepSeek4Config:
    n_layers: int
    hidden: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    window: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_dim: int
    index_topk: int
    ratios: tuple[int, ...]
    hc_mult: int
    hc_iters: int
    hc_eps: float
    n_hash: int
    n_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    clamp_exp: tuple[float, ...]
    clamp_shexp: tuple[float, ...]
    vocab_size: int
    context_length: int
    routing: Routing
    rope_theta: float = 10_000.0
    compress_theta: float = 160_000.0
    yarn: tuple[float, int, float, float] | None = None  # (factor, original context, beta_fast, beta_slow)
    rms_eps: float = 1e-6
    n_nextn: int = 0  # MTP blocks in the file, never loaded

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> DeepSeek4Config:
        m = ArchMetadata(md, ARCH, shapes, source)
        blocks = m.int("block_count")
        nextn = m.int("nextn_predict_layers", 0, low=0)
        n = blocks - nextn
        ratios = m.per_block("attention.compress_ratios", blocks)
        m.require(all(r in RATES for r in ratios[:n]), "attention.compress_ratios",
                  f"is {list(ratios[:n])}; DeepSeek-V4 layers compress at 0, 4 or 128")  # fmt: skip
        gating = m.int("expert_gating_func")
        m.require(gating == SQRT_SOFTPLUS, "expert_gating_func", f"is {gating}; DeepSeek-V4 scores by sqrtsoftplus (4)")
        head_dim, rope_dim = m.int("attention.key_length"), m.int("rope.dimension_count")
        m.require(rope_dim % 2 == 0 and rope_dim <= head_dim, "rope.dimension_count",
                  f"is {rope_dim}; it must be even and at most the head size {head_dim}")  # fmt: skip
        n_experts, top_k = m.experts()
        expert_ffn = m.int("expert_feed_forward_length", per_layer=True)
        clamp = m.per_block("swiglu_clamp_exp", blocks, float)
        shclamp = m.per_block("swiglu_clamp_shexp", blocks, float) if f"{ARCH}.swiglu_clamp_shexp" in md else clamp
        n_heads, groups = m.int("attention.head_count", per_layer=True), m.int("attention.output_group_count")
        m.require(n_heads % groups == 0, "attention.output_group_count",
                  f"({groups}) does not divide the {n_heads} heads")  # fmt: skip
        return cls(
            n_layers=n, hidden=m.int("embedding_length"), n_heads=n_heads, head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=m.int("attention.q_lora_rank"), window=m.int("attention.sliding_window"),
            o_groups=groups, o_lora_rank=m.int("attention.output_lora_rank"),
            index_heads=m.int("attention.indexer.head_count"), index_dim=m.int("attention.indexer.key_length"),
            index_topk=m.int("attention.indexer.top_k"), ratios=tuple(int(r) for r in ratios[:n]),
            hc_mult=m.int("hyper_connection.count"), hc_iters=m.int("hyper_connection.sinkhorn_iterations"),
            hc_eps=m.float("hyper_connection.epsilon"), n_hash=m.int("hash_layer_count", 0, low=0),
            n_experts=n_experts, top_k=top_k, expert_ffn=expert_ffn,
            shared_ffn=m.int("expert_shared_count", 1, low=0) * expert_ffn,
            clamp_exp=tuple(clamp[:n]), clamp_shexp=tuple(shclamp[:n]),
            vocab_size=m.tensor_shape("token_embd.weight")[0], context_length=m.int("context_length", 4096),
            routing=Routing(gating="sqrtsoftplus", norm=m.flag("expert_weights_norm", True),
                            scale=m.float("expert_weights_scale", 1.0)),
            rope_theta=m.float("rope.freq_base", 10_000.0),
            compress_theta=m.float("attention.compress_rope_freq_base", 160_000.0),
            yarn=_yarn(m, md), rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6), n_nextn=nextn,
        )  # fmt: skip

    def attention(self, layer: int) -> AttentionShape:
        return AttentionShape(self.hidden, self.n_heads, self.head_dim, self.q_lora_rank, self.window,
                              self.o_groups, self.o_lora_rank, self.index_heads, self.index_dim, self.index_topk,
                              self.rms_eps, self.ratios[layer])  # fmt: skip

    def schedule(self) -> str:
        """The attention schedule in words: runs of equal layers (`3 sliding, 2 x (CSA 4:1, HCA 128:1)`)."""
        names = [SCHEDULE_NAMES[r] for r in self.ratios]
        counts: dict[str, int] = {}
        for name in names:
            counts[name] = counts.get(name, 0) + 1
        return ", ".join(f"{c} {name}" for name, c in counts.items()) + f" (window {self.window})"


def _yarn(m: ArchMetadata, md: Mapping[str, Any]) -> tuple[float, int, float, float] | None:
    if md.get(f"{ARCH}.rope.scaling.type", "none") != "yarn":
        return None
    factor = m.float("rope.scaling.factor", 1.0)
    if factor <= 1.0:
        return None
    return (factor, m.int("rope.scaling.original_context_length"), m.float("rope.scaling.yarn_beta_fast", 32.0),
            m.float("rope.scaling.yarn_beta_slow", 1.0))  # fmt: skip


@dataclass(frozen=True)
class Rotaries:
    main: Rotary  # sliding layers
    compress: Rotary  # CSA and HCA layers, and their compressed entries


class V4MoE(ClippedMoE):
    """The MoE block with V4's routing (hash layers: ids from tid2eid) and clipped experts."""

    def __init__(self, w: Weights, i: int, cfg: DeepSeek4Config):
        super().__init__(w, i, hidden=cfg.hidden, n_experts=cfg.n_experts, expert_ffn=cfg.expert_ffn,
                         top_k=cfg.top_k, norm_topk=cfg.routing.norm, shared_ffn=cfg.shared_ffn,
                         routing=cfg.routing, limit=cfg.clamp_exp[i], shared_limit=cfg.clamp_shexp[i])  # fmt: skip
        self.tid2eid = None
        if i < cfg.n_hash:
            self.tid2eid = w.indices(f"blk.{i}.ffn_gate_tid2eid.weight", (cfg.vocab_size, cfg.top_k))
            if self.tid2eid.min() < 0 or self.tid2eid.max() >= cfg.n_experts:
                raise w_error(i, cfg.n_experts)

    def route(self, logits: torch.Tensor, forced: torch.Tensor | None, tokens: list[int] | None = None):
        if forced is None and self.tid2eid is not None:
            assert tokens is not None, "a hash-routed layer needs the step's tokens"
            forced = self.tid2eid[torch.tensor(tokens)]
        assert self.routing is not None
        return route_general(logits[:, : self.n_experts], self.top_k, self.routing, self.bias, forced, self.layer)

    def hash_ids(self, tokens: list[int]) -> list[int]:
        """The experts this layer will run for these tokens (a hash layer), in first-seen order."""
        assert self.tid2eid is not None
        return list(dict.fromkeys(self.tid2eid[torch.tensor(tokens)].reshape(-1).tolist()))


def w_error(i: int, n_experts: int):
    from moestream.errors import ModelFileError

    return ModelFileError(f"blk.{i}.ffn_gate_tid2eid names an expert outside 0..{n_experts - 1}; the file is damaged")


class DeepSeek4(MoEModel):
    arch = ARCH
    Config = DeepSeek4Config

    def __init__(self, cfg: DeepSeek4Config, w: Weights):
        self.hc_spec = HyperSpec(cfg.hc_mult, cfg.hc_iters, cfg.hc_eps, cfg.rms_eps)
        super().__init__(cfg, w)
        self.hc_head = HyperHead(w, "output_hc", cfg.hidden, self.hc_spec)
        self.residual = HyperResidual(cfg.hc_mult, self.hc_head)

    def _block(self, w: Weights, i: int) -> HyperDecoderLayer:
        return hyper_block(w, i, self.cfg.hidden, self.hc_spec, self.mixer, self.ffn)

    def mixer(self, w: Weights, i: int) -> CompressedAttention:
        return CompressedAttention(w, i, self.cfg.attention(i))

    def ffn(self, w: Weights, i: int) -> V4MoE:
        return V4MoE(w, i, self.cfg)

    def rotary(self, cfg: DeepSeek4Config) -> Rotaries:
        r = cfg.rope_dim
        main = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
        if cfg.yarn is None:
            comp = 1.0 / (cfg.compress_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
        else:
            factor, orig, fast, slow = cfg.yarn
            comp = yarn_inv_freq(r, cfg.compress_theta, factor, orig, fast, slow).float()
        return Rotaries(Rotary(main, r), Rotary(comp, r))

    def before_layers(self, step: Step) -> None:
        """Hash layers' experts are a function of the token ids: ask for them before any layer runs."""
        prefetch = getattr(step.experts, "prefetch", None)
        if prefetch is None or step.tokens is None or step.route_hook is not None:
            return  # recorded routes (a route hook) replace the hash table's choice
        for layer in self.layers:
            moe = layer.ffn
            if isinstance(moe, V4MoE) and moe.tid2eid is not None:
                prefetch(moe.expert_layer, moe.hash_ids(step.tokens))

    @staticmethod
    def memory(cfg: DeepSeek4Config) -> ModelMemory:
        """What one sequence's compressed cache and a prompt's compute hold (models/memory.py)."""
        attention = CompressedAttentionMemory(cfg.ratios, cfg.head_dim, cfg.window, cfg.index_dim, cfg.n_heads,
                                              cfg.q_lora_rank, cfg.hc_mult)  # fmt: skip
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn, always_on_ffn=cfg.shared_ffn)
        return ModelMemory(cfg.hidden, cfg.vocab_size, (attention,), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> CompressedKVCache:
        cfg = self.cfg
        return CompressedKVCache(cfg.head_dim, cfg.window, ctx, dtype,
                                 [cfg.attention(i).specs() for i in range(cfg.n_layers)])  # fmt: skip

    @staticmethod
    def load_notes(cfg: DeepSeek4Config, exact: bool = False) -> list[str]:
        """What the load summary says of a V4 file: the attention schedule, the KV bytes a token takes, the
        hash layers, and the MTP block left out."""
        per_token = DeepSeek4.memory(cfg).kv_nbytes(1 << 20, exact) / (1 << 20)
        lines = [
            f"deepseek4 attention: {cfg.schedule()}; KV cache {per_token:.0f} bytes per token "
            f"(sliding rings fixed, compressed entries per token)",
            f"deepseek4 MoE: {cfg.n_hash} hash-routed layers (experts read ahead from the token ids), then "
            f"top-{cfg.top_k} of {cfg.n_experts} by sqrtsoftplus",
        ]
        if cfg.n_nextn:
            lines.append(
                f"deepseek4 MTP: {cfg.n_nextn} multi-token-prediction block(s) skipped (neither loaded nor counted)"
            )
        return lines
