"""Synthetic deepseek4 (DeepSeek-V4 Flash and Pro) models at real shapes.

The tensors, shapes and keys are those llama.cpp's converter writes from DeepSeek's checkpoint
(conversion/deepseek.py DeepseekV4Model): the FP8 weights dequantized to Q8_0, the BF16 compressor and indexer
projections in BF16, float32 norms, sinks, position biases and hyper-connection weights in F32, the hash
layers' tid2eid as I32, and the FP4 experts as MXFP4. That is the `MXFP4` mix here; any other mix gives every
dense matrix and the experts that type (as llama-quantize's plain mixes would). No MTP block is written (the
converter drops it unless asked). The vocabulary is synth's tiny BPE one.

The attention schedule is the config's default (two heavily compressed layers, then compressed sparse and
heavily compressed alternating): DeepSeek's published compress_ratios are not in this repository.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from moestream.formats.gguf_write import TensorSpec
from moestream.synth.blocks import norm_spec, spec, uniform_spec

W_OUT = 0.002  # residual writers (attn_output_b, ffn_down): small, the embedding keeps dominating
ARCH = "deepseek4"


@dataclass(frozen=True)
class DeepSeek4Shape:
    n_layers: int
    hidden: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    n_experts: int
    top_k: int
    expert_ffn: int
    index_heads: int = 64
    index_dim: int = 128
    index_topk: int = 512
    window: int = 128
    n_hash: int = 3
    hc: int = 4
    weights_scale: float = 1.5
    swiglu_limit: float = 10.0
    context_length: int = 1_048_576
    arch: str = ARCH

    @property
    def ratios(self) -> list[int]:
        return [128] * min(2, self.n_layers) + [4 if i % 2 else 128 for i in range(max(0, self.n_layers - 2))]

    def metadata(self, name: str, file_type: int, vocab: int) -> dict[str, Any]:
        a, n = f"{ARCH}.", self.n_layers
        return {
            "general.architecture": ARCH, "general.name": name, "general.file_type": int(file_type),
            "general.quantization_version": 2, a + "block_count": n, a + "context_length": self.context_length,
            a + "embedding_length": self.hidden, a + "attention.head_count": self.n_heads,
            a + "attention.head_count_kv": 1, a + "rope.freq_base": 10_000.0,
            a + "attention.layer_norm_rms_epsilon": 1e-6, a + "expert_count": self.n_experts,
            a + "expert_used_count": self.top_k, a + "expert_gating_func": 4,
            a + "attention.key_length": self.head_dim, a + "attention.value_length": self.head_dim,
            a + "rope.scaling.type": "yarn", a + "rope.scaling.factor": 16.0,
            a + "rope.scaling.original_context_length": 65536, a + "rope.scaling.yarn_beta_fast": 32.0,
            a + "rope.scaling.yarn_beta_slow": 1.0, a + "rope.dimension_count": self.rope_dim,
            a + "attention.q_lora_rank": self.q_lora, a + "attention.sliding_window": self.window,
            a + "expert_feed_forward_length": self.expert_ffn, a + "expert_shared_count": 1,
            a + "expert_weights_scale": self.weights_scale, a + "expert_weights_norm": True,
            a + "swiglu_clamp_exp": [self.swiglu_limit] * n, a + "swiglu_clamp_shexp": [self.swiglu_limit] * n,
            a + "attention.indexer.head_count": self.index_heads, a + "attention.indexer.key_length": self.index_dim,
            a + "attention.indexer.top_k": self.index_topk, a + "attention.output_group_count": self.o_groups,
            a + "attention.output_lora_rank": self.o_lora, a + "attention.compress_ratios": self.ratios,
            a + "attention.compress_rope_freq_base": 160_000.0, a + "hyper_connection.count": self.hc,
            a + "hyper_connection.sinkhorn_iterations": 20, a + "hyper_connection.epsilon": 1e-6,
            a + "hash_layer_count": min(self.n_hash, n), a + "embedding_length_out": self.hidden * self.hc,
        }  # fmt: skip

    def tensors(self, expert_type: T, dense_type: T, vocab: int, seed: int, k_m: bool = False) -> list[TensorSpec]:
        """Every tensor of the trunk. MXFP4 (the converter's own mix): dense Q8_0, compressor and indexer
        projections BF16."""
        H, nh, D, E, F = self.hidden, self.n_heads, self.head_dim, self.n_experts, self.expert_ffn
        mxfp4 = expert_type == T.MXFP4
        dense = T.Q8_0 if mxfp4 or dense_type == T.MXFP4 else dense_type
        side = T.BF16 if mxfp4 else dense
        w_in, mix = 1.0 / math.sqrt(H), (2 + self.hc) * self.hc

        def d(name: str, shape: tuple[int, ...], std: float, t: T = dense) -> TensorSpec:
            return spec(name, t, shape, std, seed)

        def f32(name: str, shape: tuple[int, ...], std: float) -> TensorSpec:
            return spec(name, T.F32, shape, std, seed)

        specs = [d("token_embd.weight", (vocab, H), 1.0)]
        for i, rate in enumerate(self.ratios):
            p = f"blk.{i}."
            specs += [
                norm_spec(p + "attn_norm.weight", H, seed),
                uniform_spec(p + "attn_sinks.weight", nh, -1.0, 1.0, seed),
                d(p + "attn_q_a.weight", (self.q_lora, H), w_in),
                norm_spec(p + "attn_q_a_norm.weight", self.q_lora, seed),
                d(p + "attn_q_b.weight", (nh * D, self.q_lora), 1.0 / math.sqrt(self.q_lora)),
                d(p + "attn_kv.weight", (D, H), w_in), norm_spec(p + "attn_kv_a_norm.weight", D, seed),
                d(p + "attn_output_a.weight", (self.o_groups * self.o_lora, nh * D // self.o_groups), 0.01),
                d(p + "attn_output_b.weight", (H, self.o_groups * self.o_lora), W_OUT),
            ]  # fmt: skip
            for site in ("attn", "ffn"):
                specs += [f32(f"{p}hc_{site}_fn.weight", (mix, self.hc * H), 0.1 * w_in),
                          uniform_spec(f"{p}hc_{site}_base.weight", mix, -0.5, 0.5, seed),
                          uniform_spec(f"{p}hc_{site}_scale.weight", 3, 0.5, 1.5, seed)]  # fmt: skip
            if rate:
                cw = 2 * D if rate == 4 else D
                specs += [d(p + "attn_compressor_kv.weight", (cw, H), w_in, side),
                          d(p + "attn_compressor_gate.weight", (cw, H), w_in, side),
                          f32(p + "attn_compressor_ape.weight", (rate, cw), 0.5),
                          norm_spec(p + "attn_compressor_norm.weight", D, seed)]  # fmt: skip
            if rate == 4:
                di, hi = self.index_dim, self.index_heads
                specs += [d(p + "indexer_compressor_kv.weight", (2 * di, H), w_in, side),
                          d(p + "indexer_compressor_gate.weight", (2 * di, H), w_in, side),
                          f32(p + "indexer_compressor_ape.weight", (4, 2 * di), 0.5),
                          norm_spec(p + "indexer_compressor_norm.weight", di, seed),
                          d(p + "indexer.attn_q_b.weight", (hi * di, self.q_lora), 1.0 / math.sqrt(self.q_lora)),
                          d(p + "indexer.proj.weight", (hi, H), w_in, side)]  # fmt: skip
            specs += [norm_spec(p + "ffn_norm.weight", H, seed), f32(p + "ffn_gate_inp.weight", (E, H), 2.0 * w_in)]
            if i < self.n_hash:
                specs.append(_tid2eid(p + "ffn_gate_tid2eid.weight", vocab, E, self.top_k, seed))
            else:
                specs.append(uniform_spec(p + "exp_probs_b.bias", E, -0.1, 0.1, seed))
            specs += [d(p + "ffn_gate_exps.weight", (E, F, H), w_in, expert_type),
                      d(p + "ffn_up_exps.weight", (E, F, H), w_in, expert_type),
                      d(p + "ffn_down_exps.weight", (E, H, F), W_OUT, expert_type),
                      d(p + "ffn_gate_shexp.weight", (F, H), w_in), d(p + "ffn_up_shexp.weight", (F, H), w_in),
                      d(p + "ffn_down_shexp.weight", (H, F), W_OUT)]  # fmt: skip
        specs += [f32("output_hc_fn.weight", (self.hc, self.hc * H), 0.1 * w_in),
                  uniform_spec("output_hc_base.weight", self.hc, -0.5, 0.5, seed),
                  uniform_spec("output_hc_scale.weight", 1, 0.5, 1.5, seed),
                  norm_spec("output_norm.weight", H, seed), d("output.weight", (vocab, H), 2.0 * w_in)]  # fmt: skip
        return specs


def _tid2eid(name: str, vocab: int, n_experts: int, top_k: int, seed: int) -> TensorSpec:
    """A hash layer's table: each token's top_k distinct experts, I32 [vocab, top_k]."""

    def produce() -> Iterator[np.ndarray]:
        rng = np.random.default_rng((seed, zlib.crc32(name.encode())))
        yield np.argsort(rng.random((vocab, n_experts)), axis=1)[:, :top_k].astype(np.int32)

    return TensorSpec(name, T.I32, (vocab, top_k), produce)


# Real dimensions: V4-Flash from transformers' DeepseekV4Config defaults (the issue's numbers); V4-Pro from
# the issue (61 layers, hidden 7168, 128 heads, 384 experts top-6), its q LoRA rank and expert width assumed
# (1536, 3072): no V4-Pro config is in this repository
V4_SHAPES: dict[str, DeepSeek4Shape] = {
    "deepseek-v4-flash": DeepSeek4Shape(
        n_layers=43, hidden=4096, n_heads=64, head_dim=512, rope_dim=64, q_lora=1024, o_groups=8, o_lora=1024,
        n_experts=256, top_k=6, expert_ffn=2048,
    ),
    "deepseek-v4-pro": DeepSeek4Shape(
        n_layers=61, hidden=7168, n_heads=128, head_dim=512, rope_dim=64, q_lora=1536, o_groups=16, o_lora=1024,
        n_experts=384, top_k=6, expert_ffn=3072,
    ),
    "tiny-deepseek4": DeepSeek4Shape(
        n_layers=4, hidden=256, n_heads=4, head_dim=64, rope_dim=16, q_lora=64, o_groups=2, o_lora=64,
        n_experts=16, top_k=4, expert_ffn=256, index_heads=16, index_dim=64, index_topk=4, window=16, n_hash=2,
        context_length=4096,
    ),
}  # fmt: skip
