"""Synthetic glm5-next (GLM-5.3-Flash) models at real shapes.

The tensors, shapes and keys are those llama.cpp's converter writes (conversion/glm.py Glm5NextModel, checked
on a tiny checkpoint by tests/test_glm5_next.py): per block the mHC weights (hc_attn_*, hc_ffn_*: F32), a KDA
mixer (attn_q/k/v, ssm_conv1d_{q,k,v} F32, ssm_f_a/f_b, ssm_beta, ssm_a and ssm_dt.bias F32, ssm_g_a/g_b,
ssm_norm, attn_output) in three blocks of four, or in every fourth one latent attention without rope (MLA's
tensors, attn_k_b/attn_v_b split) with the pooled indexer (indexer.{attn_k, attn_q_b, k_norm, proj (F32)},
indexer_compressor_{gate, ape} F32); the first three blocks' FFN dense, the others' MoE with the correction
bias and a shared expert. No MTP block. Q4_K_M follows arches.py's rules (the same llama-quantize mix).
The vocabulary is synth's tiny BPE one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType as T

from moestream.formats.gguf_write import TensorSpec
from moestream.synth.arches import W_OUT, _Typer
from moestream.synth.blocks import norm_spec, spec, uniform_spec

ARCH = "glm5-next"


@dataclass(frozen=True)
class Glm5NextShape:
    n_layers: int
    hidden: int
    n_heads: int  # the attention's and the KDA's (the converter requires them equal)
    kda_head_dim: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    v_head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    n_dense: int
    dense_ffn: int
    index_heads: int = 32
    index_dim: int = 128
    index_topk: int = 2048
    kpool: int = 16
    conv_kernel: int = 4
    hc: int = 4
    weights_scale: float = 2.5
    swiglu_limit: float = 10.0
    context_length: int = 1_048_576
    rms_eps: float = 1e-5
    arch: str = ARCH

    def attends(self, i: int) -> bool:
        """Block i is a latent attention one (transformers' default layer_types: every fourth), else KDA."""
        return i % 4 == 3

    def metadata(self, name: str, file_type: int, vocab: int) -> dict[str, Any]:
        a, n = f"{ARCH}.", self.n_layers
        return {
            "general.architecture": ARCH, "general.name": name, "general.file_type": int(file_type),
            "general.quantization_version": 2, a + "block_count": n, a + "context_length": self.context_length,
            a + "embedding_length": self.hidden, a + "feed_forward_length": self.dense_ffn,
            a + "attention.head_count": self.n_heads,
            a + "attention.head_count_kv": [int(self.attends(i)) for i in range(n)],
            a + "attention.layer_norm_rms_epsilon": self.rms_eps, a + "expert_count": self.n_experts,
            a + "expert_used_count": self.top_k, a + "expert_group_count": 1, a + "expert_group_used_count": 1,
            a + "vocab_size": vocab, a + "attention.layer_norm_epsilon": 1e-6, a + "ssm.conv_kernel": self.conv_kernel,
            a + "kda.head_dim": self.kda_head_dim, a + "kda.gate_lower_bound": -5.0,
            a + "attention.q_lora_rank": self.q_lora, a + "attention.kv_lora_rank": self.kv_lora,
            a + "rope.dimension_count": 0, a + "attention.key_length": self.kv_lora,
            a + "attention.value_length": self.kv_lora, a + "attention.key_length_mla": self.qk_nope,
            a + "attention.value_length_mla": self.v_head_dim, a + "attention.indexer.head_count": self.index_heads,
            a + "attention.indexer.key_length": self.index_dim, a + "attention.indexer.top_k": self.index_topk,
            a + "attention.indexer.kpool": self.kpool, a + "attention.indexer.kpool_select_tail": True,
            a + "attention.indexer.types": [True] * n, a + "hyper_connection.count": self.hc,
            a + "hyper_connection.sinkhorn_iterations": 20, a + "hyper_connection.epsilon": 1e-6,
            a + "leading_dense_block_count": self.n_dense, a + "expert_feed_forward_length": self.expert_ffn,
            a + "expert_shared_count": 1, a + "expert_weights_scale": self.weights_scale,
            a + "expert_weights_norm": True, a + "swiglu_clamp_exp": [self.swiglu_limit] * n,
            a + "swiglu_clamp_shexp": [self.swiglu_limit] * n,
        }  # fmt: skip

    def tensors(self, expert_type: T, dense_type: T, vocab: int, seed: int, k_m: bool = False) -> list[TensorSpec]:
        H, w_in, mix = self.hidden, 1.0 / math.sqrt(self.hidden), (2 + self.hc) * self.hc
        q = _Typer(self.n_layers, expert_type, dense_type, k_m, seed)
        specs = [q.dense("token_embd.weight", (vocab, H), 1.0)]
        for i in range(self.n_layers):
            p = f"blk.{i}."
            for site in ("attn", "ffn"):
                specs += [spec(f"{p}hc_{site}_fn.weight", T.F32, (mix, self.hc * H), 0.1 * w_in, seed),
                          uniform_spec(f"{p}hc_{site}_base.weight", mix, -0.5, 0.5, seed),
                          uniform_spec(f"{p}hc_{site}_scale.weight", 3, 0.5, 1.5, seed)]  # fmt: skip
            specs.append(norm_spec(p + "attn_norm.weight", H, seed))
            specs += self._attention(q, p, seed) if self.attends(i) else self._kda(q, p, seed)
            specs.append(norm_spec(p + "ffn_norm.weight", H, seed))
            if i < self.n_dense:
                specs += q.dense_ffn(p, H, self.dense_ffn)
            else:
                specs += q.moe(p, H, self.n_experts, self.expert_ffn, 1, bias=True)
        specs += [norm_spec("output_norm.weight", H, seed), q.dense("output.weight", (vocab, H), 2.0 * w_in)]
        return specs

    def _kda(self, q: _Typer, p: str, seed: int) -> list[TensorSpec]:
        H, n, d = self.hidden, self.n_heads, self.kda_head_dim
        D, w_in = n * d, 1.0 / math.sqrt(self.hidden)
        conv = [spec(f"{p}ssm_conv1d_{c}.weight", T.F32, (1, D, 1, self.conv_kernel), 0.5, seed) for c in "qkv"]
        return [q.dense(p + "attn_q.weight", (D, H), w_in), q.dense(p + "attn_k.weight", (D, H), w_in),
                q.dense(p + "attn_v.weight", (D, H), w_in), *conv,
                q.dense(p + "ssm_f_a.weight", (d, H), w_in), q.dense(p + "ssm_f_b.weight", (D, d), 1.0 / math.sqrt(d)),
                q.dense(p + "ssm_beta.weight", (n, H), w_in), uniform_spec(p + "ssm_a", n, -2.0, -0.5, seed),
                uniform_spec(p + "ssm_dt.bias", D, -4.0, 0.0, seed), q.dense(p + "ssm_g_a.weight", (d, H), w_in),
                q.dense(p + "ssm_g_b.weight", (D, d), 1.0 / math.sqrt(d)), norm_spec(p + "ssm_norm.weight", d, seed),
                q.dense(p + "attn_output.weight", (H, D), W_OUT)]  # fmt: skip

    def _attention(self, q: _Typer, p: str, seed: int) -> list[TensorSpec]:
        H, nh, L, Di, hi = self.hidden, self.n_heads, self.kv_lora, self.index_dim, self.index_heads
        w_in, w_q = 1.0 / math.sqrt(self.hidden), 1.0 / math.sqrt(self.q_lora)
        x = p + "indexer."
        return [q.dense(p + "attn_q_a.weight", (self.q_lora, H), w_in),
                norm_spec(p + "attn_q_a_norm.weight", self.q_lora, seed),
                q.dense(p + "attn_q_b.weight", (nh * self.qk_nope, self.q_lora), w_q),
                q.dense(p + "attn_kv_a_mqa.weight", (L, H), w_in), norm_spec(p + "attn_kv_a_norm.weight", L, seed),
                q.dense(p + "attn_k_b.weight", (nh, L, self.qk_nope), 1.0 / math.sqrt(L)),
                q.dense(p + "attn_v_b.weight", (nh, self.v_head_dim, L), 1.0 / math.sqrt(L)),
                q.dense(p + "attn_output.weight", (H, nh * self.v_head_dim), W_OUT),
                norm_spec(x + "k_norm.weight", Di, seed), uniform_spec(x + "k_norm.bias", Di, -0.1, 0.1, seed),
                spec(x + "proj.weight", T.F32, (hi, H), w_in, seed), q.dense(x + "attn_k.weight", (Di, H), w_in),
                q.dense(x + "attn_q_b.weight", (hi * Di, self.q_lora), w_q),
                spec(p + "indexer_compressor_gate.weight", T.F32, (Di, H), w_in, seed),
                spec(p + "indexer_compressor_ape.weight", T.F32, (self.kpool, Di), 0.5, seed)]  # fmt: skip


# GLM-5.3-Flash: transformers' Glm5NextTextConfig defaults (45 blocks, hidden 4096, 64 heads, 288 experts top-8)
GLM5_NEXT_SHAPES: dict[str, Glm5NextShape] = {
    "glm-5.3-flash": Glm5NextShape(
        n_layers=45, hidden=4096, n_heads=64, kda_head_dim=128, q_lora=1536, kv_lora=512, qk_nope=256,
        v_head_dim=256, n_experts=288, top_k=8, expert_ffn=2048, n_dense=3, dense_ffn=12288,
    ),
    "tiny-glm5-next": Glm5NextShape(
        n_layers=8, hidden=256, n_heads=4, kda_head_dim=64, q_lora=128, kv_lora=128, qk_nope=64, v_head_dim=64,
        n_experts=16, top_k=4, expert_ffn=256, n_dense=1, dense_ffn=512, index_heads=8, index_dim=64,
        index_topk=16, kpool=4, context_length=4096,
    ),
}  # fmt: skip
