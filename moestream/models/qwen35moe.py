"""Qwen3.5/3.6 MoE (GGUF arch `qwen35moe`): Qwen3.5-35B-A3B, Qwen3.6-35B-A3B, Qwen3.5-122B-A10B.

A hybrid decoder: three of every four layers mix tokens with a Gated DeltaNet (linear attention with a
fixed-size recurrent state), every fourth with gated full attention. Every layer's FFN is a MoE with a
gated shared expert.

Decoder layer: x += Mixer(RMSNorm(x)); x += MoE(RMSNorm(x)).
Gated DeltaNet: see deltanet.py (conv kernel 4, the state keeps 3 inputs).
Gated attention: attn_q gives [q | gate] per head; RMSNorm on each q and k head; NeoX RoPE on the first
rope.dimension_count dims only; out = attn_output(attention * sigmoid(gate)).
MoE: softmax router, top-k renormalised, SwiGLU experts (streamed); plus sigmoid(w_s x) * SwiGLU_shared(x).

Norms: Qwen3.5 computes x_hat * (1 + w); the converter stores 1 + w, so every norm here is plain
x_hat * w (the DeltaNet output norm has no offset on either side).
MRoPE: the file carries rope sections for images; for text all sections see the same position, so it is
ordinary rotary embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moestream.models.attention import by_query_chunks
from moestream.models.base import MoEModel
from moestream.models.deltanet import GatedDeltaNet, HybridCache
from moestream.models.kv_cache import KVCache
from moestream.models.layer import Mixer
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import AttentionMemory, DeltaNetMemory, ModelMemory, MoEMemory
from moestream.models.moe import MoE
from moestream.models.ops import rms_norm
from moestream.models.rope import RoPE

ARCH = "qwen35moe"


@dataclass
class Qwen35MoeConfig:
    n_layers: int  # the trunk; MTP (nextn) blocks the converter appends are not run
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int  # rotary dims of each head (partial rotary: a quarter of head_dim)
    n_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    vocab_size: int
    context_length: int
    recurrent: list[bool]  # per layer: True = Gated DeltaNet, False = full attention
    conv_kernel: int
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    rope_theta: float = 10_000_000.0
    rms_eps: float = 1e-6

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim

    @property
    def n_linear(self) -> int:
        return sum(self.recurrent)

    @property
    def state_nbytes(self) -> int:
        """float32 conv + recurrent state of every DeltaNet layer: one sequence position's worth."""
        per_layer = (self.conv_kernel - 1) * self.conv_dim + self.n_v_heads * self.k_head_dim * self.v_head_dim
        return 4 * self.n_linear * per_layer

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> Qwen35MoeConfig:
        m = ArchMetadata(md, ARCH, shapes, source)
        blocks = m.int("block_count")
        nextn = m.int("nextn_predict_layers", 0, low=0)
        m.require(nextn < blocks, "nextn_predict_layers", f"is {nextn} of {blocks} blocks; the trunk would be empty")
        n_layers = blocks - nextn
        recurrent = m.flags("attention.recurrent_layers", n_layers)
        if recurrent is None:
            interval = m.int("full_attention_interval", 4)
            recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
        hidden, n_heads, n_kv_heads, head_dim = m.attention()
        rot_dim = m.int("rope.dimension_count", head_dim)
        m.require(rot_dim <= head_dim and rot_dim % 2 == 0, "rope.dimension_count",
                  f"is {rot_dim}; it must be even and at most the head size {head_dim}")  # fmt: skip
        n_v_heads, n_k_heads = m.int("ssm.time_step_rank"), m.int("ssm.group_count")
        m.require(n_v_heads % n_k_heads == 0, "ssm.group_count",
                  f"({n_k_heads} key heads) does not divide the {n_v_heads} value heads evenly")  # fmt: skip
        inner = m.int("ssm.inner_size")
        m.require(inner % n_v_heads == 0, "ssm.inner_size", f"({inner}) is not a multiple of the "
                  f"{n_v_heads} value heads")  # fmt: skip
        n_experts, top_k = m.experts()
        shared_ffn = m.int("expert_shared_feed_forward_length", 0, low=0)  # optional: else the tensors say
        if not shared_ffn:
            shared_ffn = m.tensor_shape("blk.0.ffn_gate_shexp.weight")[0]
        return cls(
            n_layers=n_layers,
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rot_dim=rot_dim,
            n_experts=n_experts,
            top_k=top_k,
            expert_ffn=m.int("expert_feed_forward_length", per_layer=True),
            shared_ffn=shared_ffn,
            vocab_size=m.tensor_shape("token_embd.weight")[0],
            context_length=m.int("context_length", 4096),
            recurrent=recurrent,
            conv_kernel=m.int("ssm.conv_kernel"),
            n_k_heads=n_k_heads,
            n_v_heads=n_v_heads,
            k_head_dim=m.int("ssm.state_size"),
            v_head_dim=inner // n_v_heads,
            rope_theta=m.float("rope.freq_base", 10_000_000.0),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6),
        )


# ---- layers --------------------------------------------------------------------------------------


class GatedAttention(Mixer):
    def __init__(self, w: Weights, i: int, cfg: Qwen35MoeConfig):
        p = f"blk.{i}."
        H, q_dim, kv_dim = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv = w.fused([(p + "attn_q.weight", 2 * q_dim, H), (p + "attn_k.weight", kv_dim, H),
                            (p + "attn_v.weight", kv_dim, H)])  # fmt: skip
        self.o = w.linear(p + "attn_output.weight", H, q_dim)
        self.q_norm = w.vector(p + "attn_q_norm.weight", cfg.head_dim)
        self.k_norm = w.vector(p + "attn_k_norm.weight", cfg.head_dim)
        self.cfg = cfg

    def __call__(self, x: torch.Tensor, layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        return by_query_chunks(x, kv, pos, lambda xc, p: self._attend(xc, layer, kv, p, rope))

    def _attend(self, x: torch.Tensor, layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        cfg = self.cfg
        T, H, Hkv, D = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qg, k, v = self.qkv(x)
        qg = qg.view(T, H, 2, D)  # per head: D query dims, then D output-gate dims
        q = rope(rms_norm(qg[:, :, 0], self.q_norm, cfg.rms_eps), pos)
        k = rope(rms_norm(k.view(T, Hkv, D), self.k_norm, cfg.rms_eps), pos)
        keys, values = kv.update(layer, pos, k, v.view(T, Hkv, D))
        out = kv.attend(q, keys, values, pos) * torch.sigmoid(qg[:, :, 1])
        return self.o(out.reshape(T, H * D))


# ---- the model -----------------------------------------------------------------------------------


class Qwen35Moe(MoEModel):
    arch = ARCH
    Config = Qwen35MoeConfig

    ffn_norm = "post_attention_norm"

    def mixer(self, w: Weights, i: int) -> GatedDeltaNet | GatedAttention:
        return GatedDeltaNet(w, i, self.cfg) if self.cfg.recurrent[i] else GatedAttention(w, i, self.cfg)

    def ffn(self, w: Weights, i: int) -> MoE:
        cfg = self.cfg
        return MoE(w, i, hidden=cfg.hidden, n_experts=cfg.n_experts, expert_ffn=cfg.expert_ffn, top_k=cfg.top_k,
                   norm_topk=True, shared_ffn=cfg.shared_ffn, shared_gate=True)  # fmt: skip

    def rotary(self, cfg: Qwen35MoeConfig) -> RoPE:
        return RoPE(cfg.head_dim, cfg.rope_theta, cfg.rot_dim, max_pos=min(cfg.context_length, 4096))

    @staticmethod
    def memory(cfg: Qwen35MoeConfig) -> ModelMemory:
        """What one sequence's KV cache and recurrent state and a prompt's compute hold (models/memory.py)."""
        attention = AttentionMemory(cfg.n_layers - cfg.n_linear, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, gated=True)
        deltanet = DeltaNetMemory(cfg.conv_kernel, cfg.conv_dim, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim,
                                  cfg.state_nbytes)  # fmt: skip
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn, always_on_ffn=cfg.shared_ffn)
        return ModelMemory(cfg.hidden, cfg.vocab_size, (attention, deltanet), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> HybridCache:
        return HybridCache(self.cfg, ctx, dtype)
