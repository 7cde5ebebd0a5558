"""Qwen3-MoE (GGUF arch `qwen3moe`): Qwen3-30B-A3B, Qwen3-235B-A22B.

Decoder layer: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)).
Attention: grouped-query, RMSNorm on each head of q and k, NeoX-style RoPE (rotate halves), no biases.
MoE: softmax router over all experts, top-k, the k weights renormalised to sum to 1, SwiGLU experts
(down(silu(gate(x)) * up(x))). The routed experts come from an expert provider (the streaming cache);
everything else is resident.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moestream.compute import kernels, linear
from moestream.models.attention import by_query_chunks
from moestream.models.base import MoEModel
from moestream.models.kv_cache import KVCache
from moestream.models.layer import Mixer
from moestream.models.loader import ArchMetadata, Weights
from moestream.models.memory import AttentionMemory, ModelMemory, MoEMemory
from moestream.models.moe import MoE
from moestream.models.ops import rms_norm
from moestream.models.rope import RoPE

ARCH = "qwen3moe"


@dataclass
class Qwen3MoeConfig:
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
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    norm_topk_prob: bool = True
    shared_ffn: int = 0  # > 0: one always-on shared expert per layer (synthetic files shaped like Qwen3.6)

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str = "model file"
    ) -> Qwen3MoeConfig:
        m = ArchMetadata(md, ARCH, shapes, source)
        hidden, n_heads, n_kv_heads, head_dim = m.attention()
        m.require(head_dim % 2 == 0, "attention.key_length", f"is {head_dim}; rotary embedding needs it even")
        n_experts, top_k = m.experts()
        shared_ffn = m.int("expert_shared_feed_forward_length", 0, low=0)
        if not shared_ffn and "blk.0.ffn_gate_shexp.weight" in shapes:
            shared_ffn = m.tensor_shape("blk.0.ffn_gate_shexp.weight")[0]
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
            rope_theta=m.float("rope.freq_base", 1_000_000.0),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6),
            norm_topk_prob=m.flag("expert_weights_norm", True),
            shared_ffn=shared_ffn,
        )


class Attention(Mixer):
    def __init__(self, w: Weights, i: int, cfg: Qwen3MoeConfig):
        p = f"blk.{i}."
        H, q_dim, kv_dim = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q = w.linear(p + "attn_q.weight", q_dim, H)
        k = w.linear(p + "attn_k.weight", kv_dim, H)
        v = w.linear(p + "attn_v.weight", kv_dim, H)
        self.qkv = linear.concat([q, k, v])  # one matmul instead of three when the forms agree
        self.q, self.k, self.v = (None, None, None) if self.qkv is not None else (q, k, v)
        self.o = w.linear(p + "attn_output.weight", H, q_dim)
        self.q_norm = w.vector(p + "attn_q_norm.weight", cfg.head_dim)
        self.k_norm = w.vector(p + "attn_k_norm.weight", cfg.head_dim)
        self.cfg = cfg

    def rows(
        self, x: torch.Tensor, norm: torch.Tensor, eps: float, layer: int, kvs: list, positions: list[int], rope: RoPE
    ) -> torch.Tensor:
        """One token of each of B sequences: the fused native block on all rows at once where the forms
        allow, else each row's own fused block, else the plain path."""
        a = self.fused_decode_rows(x, norm, layer, kvs, positions, rope)
        if a is not None or len(kvs) == 1:
            return a if a is not None else self(rms_norm(x, norm, eps), layer, kvs[0], positions[0], rope)
        rows = []
        for b, (kv, p) in enumerate(zip(kvs, positions, strict=True)):  # the rows' caches may differ in form
            xb = x[b : b + 1]
            a = self.fused_decode_rows(xb, norm, layer, [kv], [p], rope)
            rows.append(a if a is not None else self(rms_norm(xb, norm, eps), layer, kv, p, rope))
        return torch.cat(rows)

    def fused_decode_rows(
        self, x: torch.Tensor, norm: torch.Tensor, layer: int, kvs: list[KVCache], positions: list[int], rope: RoPE
    ) -> torch.Tensor | None:
        """The whole block (norm included) for rows of x [B, hidden], each over its own cache at its own
        position, in one native call that reads the projections once for all rows (each row's result as it is
        alone); None when the forms don't allow."""
        qkv, o, cfg = self.qkv, self.o, self.cfg
        caches = [(kv.k[layer], kv.v[layer]) for kv in kvs]
        dtypes = {kc.dtype if kc is not None else None for kc, _ in caches}
        if (
            not kernels.available()
            or qkv is None
            or qkv.kind != "lane"
            or o.kind != "lane"
            or len(dtypes) != 1
            or dtypes.pop() not in kernels.KV_TYPES
            or any(p >= kc.shape[0] for (kc, _), p in zip(caches, positions, strict=True))
        ):
            return None
        rope.ensure(max(positions) + 1)
        return kernels.attn_block_decode_rows(
            x, norm, cfg.rms_eps, qkv, self.q_norm, self.k_norm, (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim),
            [rope.table_rows(p) for p in positions], caches, positions, o,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        return by_query_chunks(x, kv, pos, lambda xc, p: self._attend(xc, layer, kv, p, rope))

    def _attend(self, x: torch.Tensor, layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        if self.qkv is not None:
            q, k, v = self.qkv(x).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.reshape(T, cfg.n_heads, cfg.head_dim)
        k = k.reshape(T, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.n_kv_heads, cfg.head_dim)
        q = rope(rms_norm(q, self.q_norm, cfg.rms_eps), pos)
        k = rope(rms_norm(k, self.k_norm, cfg.rms_eps), pos)
        keys, values = kv.update(layer, pos, k, v)
        out = kv.attend(q, keys, values, pos)
        return self.o(out.reshape(T, cfg.n_heads * cfg.head_dim))


class Qwen3Moe(MoEModel):
    arch = ARCH
    Config = Qwen3MoeConfig

    def mixer(self, w: Weights, i: int) -> Attention:
        return Attention(w, i, self.cfg)

    def ffn(self, w: Weights, i: int) -> MoE:
        cfg = self.cfg
        return MoE(w, i, hidden=cfg.hidden, n_experts=cfg.n_experts, expert_ffn=cfg.expert_ffn, top_k=cfg.top_k,
                   norm_topk=cfg.norm_topk_prob, shared_ffn=cfg.shared_ffn)  # fmt: skip

    def rotary(self, cfg: Qwen3MoeConfig) -> RoPE:
        return RoPE(cfg.head_dim, cfg.rope_theta, max_pos=min(cfg.context_length, 4096))

    @staticmethod
    def memory(cfg: Qwen3MoeConfig) -> ModelMemory:
        """What one sequence's KV cache and a prompt's compute hold (models/memory.py). A shared expert (the
        synthetic Qwen3.6-shaped files) is not in the account: the plans for those files stay as they were."""
        attention = AttentionMemory(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        moe = MoEMemory(cfg.n_experts, cfg.top_k, cfg.expert_ffn)
        return ModelMemory(cfg.hidden, cfg.vocab_size, (attention,), moe)

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> KVCache:
        return KVCache([self.cfg.n_kv_heads] * self.cfg.n_layers, self.cfg.head_dim, ctx, dtype)
