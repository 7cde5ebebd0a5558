"""The plain decoder the older MoE families share (Mixtral, OLMoE, Qwen2-MoE): grouped-query attention with
NeoX-style RoPE over the whole head, optional q/k/v/o biases and an optional q/k RMSNorm over the whole
projection, then a softmax-routed MoE. Each architecture file reads its own metadata into a GQAMoEConfig
and says which of the options it takes.

Decoder layer: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)).

llama's q/k rotary layout: llama.cpp's converter permutes the rows of q_proj and k_proj of every llama-arch
model so that each head's rotated pairs are adjacent (its "normal" RoPE) instead of half a head apart
(transformers' rotate_half). The rows are put back at load (`rope_pairs`), after which the NeoX form applies:
the same logits, and the attention code of every other architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moestream.compute import linear
from moestream.models.base import MoEModel
from moestream.models.kv_cache import KVCache
from moestream.models.layer import SplitMixer
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import AttentionMemory, ModelMemory, MoEMemory
from moestream.models.moe import MoE
from moestream.models.ops import rms_norm
from moestream.models.rope import RoPE
from moestream.models.rows import Ops


@dataclass
class GQAMoEConfig:
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
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6
    norm_topk_prob: bool = False
    shared_ffn: int = 0  # > 0: one always-on shared expert per layer
    shared_gate: bool = False  # the shared expert scaled by sigmoid(x . ffn_gate_inp_shexp)
    rope_dim: int = 0  # the rotated dims at the start of each head (0: the whole head)


def attention_fields(
    m: ArchMetadata, default_theta: float = 10_000.0, *, experts: bool = True, partial_rope: bool = False
) -> dict[str, Any]:
    """The fields every architecture of the family reads the same way (attention, experts, vocabulary, RoPE
    base, norm epsilon), checked; the expert sizes and routing flags are each file's own. experts=False: a
    dense file's (models/dense.py), which has no expert keys. partial_rope: the architecture rotates the
    first rope.dimension_count dims of each head (rope_dim), not necessarily all of them."""
    hidden, n_heads, n_kv_heads, head_dim = m.attention()
    m.require(head_dim % 2 == 0, "attention.key_length", f"is {head_dim}; rotary embedding needs it even")
    rot = m.int("rope.dimension_count", head_dim)
    if partial_rope:
        m.require(rot % 2 == 0 and rot <= head_dim, "rope.dimension_count",
                  f"is {rot}; it must be even and at most the head size {head_dim}")  # fmt: skip
    else:
        m.require(rot == head_dim, "rope.dimension_count", f"is {rot}; moestream rotates whole heads ({head_dim})")
    scaling = m.md.get(f"{m.arch}.rope.scaling.type", "none")
    factor = m.md.get(f"{m.arch}.rope.scaling.factor", 1.0)
    m.require(scaling in ("none", None) or factor == 1.0, "rope.scaling.type",
              f"is {scaling!r}; moestream runs this architecture with plain RoPE only")  # fmt: skip
    if "rope_freqs.weight" in m.shapes:
        raise m.error("rope.freq_base", "comes with per-frequency factors (rope_freqs), which moestream does not run")
    fields = dict(n_layers=m.int("block_count"), hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads)
    fields["head_dim"] = head_dim
    if partial_rope:
        fields["rope_dim"] = rot
    if experts:
        fields["n_experts"], fields["top_k"] = m.experts()
    return fields | dict(
        vocab_size=m.tensor_shape("token_embd.weight")[0],
        context_length=m.int("context_length", 4096),
        rope_theta=m.float("rope.freq_base", default_theta),
        rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6),
    )


def unpermute_rows(n_heads: int, head_dim: int) -> list[int]:
    """Row order that undoes the converter's llama permute: within a head the file holds rows
    (pair i, member j) at 2i + j; transformers' order is j * head_dim/2 + i."""
    half = head_dim // 2
    return [h * head_dim + 2 * i + j for h in range(n_heads) for j in range(2) for i in range(half)]


class GQAttention(SplitMixer):
    def __init__(self, w: Weights, i: int, cfg: GQAMoEConfig, *, rope_pairs: bool = False, qk_norm: bool = False):
        """rope_pairs: the file is llama-arch (q/k rows permuted by the converter); qk_norm: RMSNorm over the
        whole q and k projections (OLMoE). Biases are loaded wherever the file has them, as llama.cpp does."""
        p = f"blk.{i}."
        H, D = cfg.hidden, cfg.head_dim
        dims = {"q": cfg.n_heads * D, "k": cfg.n_kv_heads * D, "v": cfg.n_kv_heads * D}
        heads = {"q": cfg.n_heads, "k": cfg.n_kv_heads}
        parts, biases = [], []
        for name, dim in dims.items():
            order = unpermute_rows(heads[name], D) if rope_pairs and name in heads else None
            t = f"{p}attn_{name}."
            if order is None:
                parts.append(w.linear(t + "weight", dim, H))
            else:
                parts.append(w.linear_rows(t + "weight", dim, H, order))
            bias = w.vector(t + "bias", dim) if w.has(t + "bias") else None
            biases.append(bias if bias is None or order is None else bias[order])
        self.qkv = linear.concat(parts)  # one matmul instead of three when the forms agree
        self.q, self.k, self.v = (None, None, None) if self.qkv is not None else parts
        self.bias = None
        if any(b is not None for b in biases):
            zeros = [torch.zeros(d) for d in dims.values()]
            self.bias = torch.cat([b if b is not None else z for b, z in zip(biases, zeros, strict=True)])
        self.o = w.linear(p + "attn_output.weight", H, dims["q"])
        self.o_bias = w.vector(p + "attn_output.bias", H) if w.has(p + "attn_output.bias") else None
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = w.vector(p + "attn_q_norm.weight", dims["q"])
            self.k_norm = w.vector(p + "attn_k_norm.weight", dims["k"])
        self.cfg = cfg

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor]:
        """(q|k|v [T, nq + 2 nkv] with biases,)"""
        qkv = (
            ops.mm(self.qkv, x)
            if self.qkv is not None
            else torch.cat([ops.mm(p, x) for p in (self.q, self.k, self.v)], -1)
        )
        return (qkv if self.bias is None else qkv + self.bias,)

    def core(self, parts: tuple[torch.Tensor], layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        """Norms, RoPE, the cache update and attention of T tokens at pos..: [T, nq]."""
        cfg = self.cfg
        (qkv,) = parts
        T = qkv.shape[0]
        nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        if self.q_norm is not None:
            q = rms_norm(q.contiguous(), self.q_norm, cfg.rms_eps)
            k = rms_norm(k.contiguous(), self.k_norm, cfg.rms_eps)
        q = rope(q.reshape(T, cfg.n_heads, cfg.head_dim), pos)
        k = rope(k.reshape(T, cfg.n_kv_heads, cfg.head_dim), pos)
        keys, values = kv.update(layer, pos, k, v.reshape(T, cfg.n_kv_heads, cfg.head_dim))
        return kv.attend(q, keys, values, pos).reshape(T, nq)

    def output(self, a: torch.Tensor, ops: Ops) -> torch.Tensor:
        out = ops.mm(self.o, a)
        return out if self.o_bias is None else out + self.o_bias


class GQAMoEModel(MoEModel):
    """An architecture of this family: a subclass sets arch, Config and the attention options."""

    rope_pairs = False
    qk_norm = False

    def mixer(self, w: Weights, i: int) -> GQAttention:
        return GQAttention(w, i, self.cfg, rope_pairs=self.rope_pairs, qk_norm=self.qk_norm)

    def ffn(self, w: Weights, i: int) -> MoE:
        cfg = self.cfg
        return MoE(w, i, hidden=cfg.hidden, n_experts=cfg.n_experts, expert_ffn=cfg.expert_ffn, top_k=cfg.top_k,
                   norm_topk=cfg.norm_topk_prob, shared_ffn=cfg.shared_ffn, shared_gate=cfg.shared_gate)  # fmt: skip

    def rotary(self, cfg: GQAMoEConfig) -> RoPE:
        return RoPE(cfg.head_dim, cfg.rope_theta, cfg.rope_dim or None, max_pos=min(cfg.context_length, 4096))

    @staticmethod
    def memory(cfg: GQAMoEConfig) -> ModelMemory:
        """What one sequence's KV cache and a prompt's compute hold (models/memory.py); the shared expert's
        gate logit is counted whether or not the file has one."""
        attention = AttentionMemory(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn, always_on_ffn=cfg.shared_ffn, gate_logits=1)
        return ModelMemory(cfg.hidden, cfg.vocab_size, (attention,), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> KVCache:
        return KVCache([self.cfg.n_kv_heads] * self.cfg.n_layers, self.cfg.head_dim, ctx, dtype)
