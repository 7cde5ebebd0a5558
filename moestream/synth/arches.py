"""Synthetic deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2) and glm4moe (GLM-4.5/4.6) models at real shapes.

The tensors, shapes and metadata keys are those llama.cpp's convert_hf_to_gguf.py writes for these models
(DeepseekV2Model: MLA with kv_b_proj split into attn_k_b/attn_v_b, no multi-token-prediction block;
Glm4MoeModel: q/k/v biases, partial rotary, the nextn block appended after the trunk), with random weights
as synth.py makes them. The vocabulary is synth's tiny BPE one (765 tokens) in every shape: the real
vocabularies (102k-164k) would only add a dense embedding and head.

Q4_K_M follows llama-quantize (llama_tensor_get_type): output in Q6_K; every ffn_down (dense, routed and
shared) in Q6_K on the blocks use_more_bits picks, counted over all blocks; glm's attn_v in Q6_K on the same
rule; the rest Q4_K; then any K-quant whose rows are not whole 256-blocks falls back (fit_rows): attn_k_b
(rows of qk_nope = 128) to Q5_0 in every MLA model, V2-Lite's and GLM-4.5-Air's 1408-wide expert down and
10944-wide dense down projections to Q5_0 (Q8_0 where they wanted Q6_K). No attn_kv_a_mqa, attn_q_a or
attn_kv_b rule exists there (DeepSeek has no MoE count of 8, the case llama.cpp's attn_output rule needs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType as T

from moestream.formats.gguf_write import TensorSpec
from moestream.synth.blocks import fit_rows, norm_spec, spec, uniform_spec, use_more_bits

W_OUT = 0.002  # residual writers (attn_output, ffn_down): small, the embedding keeps dominating


@dataclass(frozen=True)
class DeepSeekShape:
    n_layers: int  # every block of the trunk, the leading dense ones included
    hidden: int
    n_heads: int
    q_lora: int  # 0: the query is one attn_q (V2-Lite)
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    n_shared: int
    n_dense: int  # leading dense blocks (first_k_dense_replace)
    dense_ffn: int
    gating: int  # 1 softmax (V2), 2 sigmoid with the exp_probs_b correction bias (V3, Kimi-K2)
    weights_norm: bool
    weights_scale: float
    n_group: int = 1
    topk_group: int = 1
    context_length: int = 163840
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6
    yarn_factor: float = 0.0  # 0: no rope scaling
    yarn_orig_ctx: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    mscale_all_dim: float = 0.0
    arch: str = "deepseek2"  # deepseek32 / glm-dsa: with a sparse attention's indexer (index_heads)
    index_heads: int = 0  # 0: no indexer
    index_dim: int = 128
    index_topk: int = 2048
    index_full: tuple[bool, ...] = ()  # which blocks run their indexer (glm-dsa's types); empty: every one

    def metadata(self, name: str, file_type: int, vocab: int) -> dict[str, Any]:
        """The general.* and deepseek2.* keys DeepseekV2Model.set_gguf_parameters (and its base) writes."""
        a = f"{self.arch}."
        md: dict[str, Any] = {
            "general.architecture": self.arch,
            "general.name": name,
            "general.file_type": int(file_type),
            "general.quantization_version": 2,
            a + "block_count": self.n_layers,
            a + "context_length": self.context_length,
            a + "embedding_length": self.hidden,
            a + "feed_forward_length": self.dense_ffn,
            a + "attention.head_count": self.n_heads,
            a + "attention.head_count_kv": 1,  # MLA is written as MQA over the [latent | rope] key
            a + "rope.freq_base": float(self.rope_theta),
            a + "attention.layer_norm_rms_epsilon": float(self.rms_eps),
            a + "expert_count": self.n_experts,
            a + "expert_used_count": self.top_k,
            a + "expert_group_count": self.n_group,
            a + "expert_group_used_count": self.topk_group,
            a + "expert_gating_func": self.gating,
            a + "leading_dense_block_count": self.n_dense,
            a + "vocab_size": vocab,
            a + "attention.kv_lora_rank": self.kv_lora,
            a + "attention.key_length": self.kv_lora + self.qk_rope,
            a + "attention.value_length": self.kv_lora,
            a + "attention.key_length_mla": self.qk_nope + self.qk_rope,
            a + "attention.value_length_mla": self.v_head_dim,
            a + "expert_feed_forward_length": self.expert_ffn,
            a + "expert_shared_count": self.n_shared,
            a + "expert_weights_scale": float(self.weights_scale),
            a + "rope.dimension_count": self.qk_rope,
        }
        if self.q_lora:
            md[a + "attention.q_lora_rank"] = self.q_lora
        if self.weights_norm:  # the converter writes the key only when the config sets it true
            md[a + "expert_weights_norm"] = True
        if self.index_heads:
            ix = a + "attention.indexer."
            md |= {ix + "head_count": self.index_heads, ix + "key_length": self.index_dim}
            md[ix + "top_k"] = self.index_topk
            if self.arch == "glm-dsa":
                md[a + "attention.indexer.types"] = [self.indexed(i) for i in range(self.n_layers)]
        if self.yarn_factor:
            md |= {
                a + "rope.scaling.type": "yarn",
                a + "rope.scaling.factor": float(self.yarn_factor),
                a + "rope.scaling.original_context_length": self.yarn_orig_ctx,
                a + "rope.scaling.yarn_beta_fast": float(self.yarn_beta_fast),
                a + "rope.scaling.yarn_beta_slow": float(self.yarn_beta_slow),
                a + "rope.scaling.yarn_log_multiplier": 0.1 * self.mscale_all_dim,
            }
        return md

    def tensors(self, expert_type: T, dense_type: T, vocab: int, seed: int, k_m: bool = False) -> list[TensorSpec]:
        """Every tensor, in the converter's order within a block. k_m: a Q4_K_M file (q4_k_m_type)."""
        H, nh, L, R = self.hidden, self.n_heads, self.kv_lora, self.qk_rope
        qk, w_in = self.qk_nope + R, 1.0 / math.sqrt(H)
        q = _Typer(self.n_layers, expert_type, dense_type, k_m, seed)
        specs = [q.dense("token_embd.weight", (vocab, H), 1.0)]
        for i in range(self.n_layers):
            p = f"blk.{i}."
            specs.append(norm_spec(p + "attn_norm.weight", H, seed))
            if self.q_lora:
                specs += [
                    q.dense(p + "attn_q_a.weight", (self.q_lora, H), w_in),
                    norm_spec(p + "attn_q_a_norm.weight", self.q_lora, seed),
                    q.dense(p + "attn_q_b.weight", (nh * qk, self.q_lora), 1.0 / math.sqrt(self.q_lora)),
                ]
            else:
                specs.append(q.dense(p + "attn_q.weight", (nh * qk, H), w_in))
            specs += [
                q.dense(p + "attn_kv_a_mqa.weight", (L + R, H), w_in),
                norm_spec(p + "attn_kv_a_norm.weight", L, seed),
                # kv_b_proj split per head: k_b transposed [H, L, nope], v_b [H, v, L]; the latent is normed
                q.dense(p + "attn_k_b.weight", (nh, L, self.qk_nope), 1.0 / math.sqrt(L)),
                q.dense(p + "attn_v_b.weight", (nh, self.v_head_dim, L), 1.0 / math.sqrt(L)),
                q.dense(p + "attn_output.weight", (H, nh * self.v_head_dim), W_OUT),
                *self.indexer(q, p, i, seed),
                norm_spec(p + "ffn_norm.weight", H, seed),
            ]
            if i < self.n_dense:
                specs += q.dense_ffn(p, H, self.dense_ffn)
            else:
                specs += q.moe(p, H, self.n_experts, self.expert_ffn, self.n_shared, bias=self.gating == 2)
        specs += [norm_spec("output_norm.weight", H, seed), q.dense("output.weight", (vocab, H), 2.0 * w_in)]
        return specs

    def indexed(self, i: int) -> bool:
        return self.index_heads > 0 and (not self.index_full or self.index_full[i])

    def indexer(self, q: _Typer, p: str, i: int, seed: int) -> list[TensorSpec]:
        """Block i's indexer as the converter writes it (INDEXER_PROJ in F32), or none."""
        if not self.indexed(i):
            return []
        H, D, nh = self.hidden, self.index_dim, self.index_heads
        x = p + "indexer."
        return [
            norm_spec(x + "k_norm.weight", D, seed),
            uniform_spec(x + "k_norm.bias", D, -0.1, 0.1, seed),
            spec(x + "proj.weight", T.F32, (nh, H), 1.0 / math.sqrt(H), seed),
            q.dense(x + "attn_k.weight", (D, H), 1.0 / math.sqrt(H)),
            q.dense(x + "attn_q_b.weight", (nh * D, self.q_lora), 1.0 / math.sqrt(self.q_lora)),
        ]


@dataclass(frozen=True)
class GlmShape:
    n_layers: int  # blocks of the trunk (num_hidden_layers), the leading dense ones included
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    n_shared: int
    n_dense: int
    dense_ffn: int
    qk_norm: bool
    weights_scale: float
    nextn: int = 1  # multi-token-prediction blocks after the trunk (written, never run)
    weights_norm: bool = True
    context_length: int = 131072
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-5
    arch: str = "glm4moe"

    @property
    def n_blocks(self) -> int:
        return self.n_layers + self.nextn

    def metadata(self, name: str, file_type: int, vocab: int) -> dict[str, Any]:
        """The general.* and glm4moe.* keys Glm4MoeModel.set_gguf_parameters (and its base) writes."""
        a = f"{self.arch}."
        return {
            "general.architecture": self.arch,
            "general.name": name,
            "general.file_type": int(file_type),
            "general.quantization_version": 2,
            a + "block_count": self.n_blocks,  # the nextn block counts
            a + "context_length": self.context_length,
            a + "embedding_length": self.hidden,
            a + "feed_forward_length": self.dense_ffn,
            a + "attention.head_count": self.n_heads,
            a + "attention.head_count_kv": self.n_kv_heads,
            a + "rope.freq_base": float(self.rope_theta),
            a + "attention.layer_norm_rms_epsilon": float(self.rms_eps),
            a + "expert_used_count": self.top_k,
            a + "expert_group_count": 1,
            a + "expert_group_used_count": 1,
            a + "attention.key_length": self.head_dim,
            a + "attention.value_length": self.head_dim,
            a + "rope.dimension_count": self.head_dim // 2,  # partial_rotary_factor 0.5
            a + "expert_count": self.n_experts,
            a + "expert_feed_forward_length": self.expert_ffn,
            a + "expert_shared_count": self.n_shared,
            a + "leading_dense_block_count": self.n_dense,
            a + "expert_gating_func": 2,
            a + "expert_weights_scale": float(self.weights_scale),
            a + "expert_weights_norm": self.weights_norm,
            a + "nextn_predict_layers": self.nextn,
        }

    def tensors(self, expert_type: T, dense_type: T, vocab: int, seed: int, k_m: bool = False) -> list[TensorSpec]:
        H, D, w_in = self.hidden, self.head_dim, 1.0 / math.sqrt(self.hidden)
        q_dim, kv_dim = self.n_heads * D, self.n_kv_heads * D
        q = _Typer(self.n_blocks, expert_type, dense_type, k_m, seed, attn_v_rule=True)
        specs = [q.dense("token_embd.weight", (vocab, H), 1.0)]
        for i in range(self.n_blocks):
            p = f"blk.{i}."
            specs += [
                norm_spec(p + "attn_norm.weight", H, seed),
                q.dense(p + "attn_q.weight", (q_dim, H), w_in),
                uniform_spec(p + "attn_q.bias", q_dim, -0.1, 0.1, seed),
                q.dense(p + "attn_k.weight", (kv_dim, H), w_in),
                uniform_spec(p + "attn_k.bias", kv_dim, -0.1, 0.1, seed),
                q.dense(p + "attn_v.weight", (kv_dim, H), w_in),
                uniform_spec(p + "attn_v.bias", kv_dim, -0.1, 0.1, seed),
                q.dense(p + "attn_output.weight", (H, q_dim), W_OUT),
            ]
            if self.qk_norm:
                specs += [norm_spec(p + "attn_q_norm.weight", D, seed), norm_spec(p + "attn_k_norm.weight", D, seed)]
            specs.append(norm_spec(p + "post_attention_norm.weight", H, seed))
            if i < self.n_dense:
                specs += q.dense_ffn(p, H, self.dense_ffn)
            else:
                specs += q.moe(p, H, self.n_experts, self.expert_ffn, self.n_shared, bias=True)
            if i >= self.n_layers:  # the nextn block's own parts
                specs += [
                    q.dense(p + "nextn.eh_proj.weight", (H, 2 * H), 1.0 / math.sqrt(2 * H)),
                    q.dense(p + "nextn.embed_tokens.weight", (vocab, H), 1.0),
                    norm_spec(p + "nextn.enorm.weight", H, seed),
                    norm_spec(p + "nextn.hnorm.weight", H, seed),
                    q.dense(p + "nextn.shared_head_head.weight", (vocab, H), 2.0 * w_in),
                    norm_spec(p + "nextn.shared_head_norm.weight", H, seed),
                ]
        specs += [norm_spec("output_norm.weight", H, seed), q.dense("output.weight", (vocab, H), 2.0 * w_in)]
        return specs


def llama_cpp_loads(s: DeepSeekShape | GlmShape) -> bool:
    """False for a q-LoRA-less deepseek2 slice: llama.cpp reads such a file as V2-Lite only at 26 or 27 blocks."""
    return not (isinstance(s, DeepSeekShape) and not s.q_lora and s.n_layers not in (26, 27))


def q4_k_m_type(name: str, layer: int, n_blocks: int, attn_v_rule: bool = False) -> T:
    """llama-quantize's wanted type for a tensor of a Q4_K_M file of these archs, before fit_rows."""
    more = use_more_bits(layer, n_blocks)
    if name == "output.weight" or ("ffn_down" in name and more) or (attn_v_rule and "attn_v.weight" in name and more):
        return T.Q6_K
    return T.Q4_K


class _Typer:
    """Makes each tensor's spec in the type the file's quant mix gives it."""

    def __init__(self, n_blocks: int, expert: T, dense: T, k_m: bool, seed: int, attn_v_rule: bool = False):
        self.n_blocks, self.expert, self.dense_t, self.k_m, self.seed = n_blocks, expert, dense, k_m, seed
        self.attn_v_rule = attn_v_rule

    def _spec(self, name: str, default: T, shape: tuple[int, ...], std: float) -> TensorSpec:
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        t = q4_k_m_type(name, layer, self.n_blocks, self.attn_v_rule) if self.k_m else default
        return spec(name, fit_rows(t, shape[-1]), shape, std, self.seed)

    def dense(self, name: str, shape: tuple[int, ...], std: float) -> TensorSpec:
        return self._spec(name, self.dense_t, shape, std)

    def dense_ffn(self, p: str, H: int, F: int) -> list[TensorSpec]:
        w_in = 1.0 / math.sqrt(H)
        return [
            self.dense(p + "ffn_gate.weight", (F, H), w_in),
            self.dense(p + "ffn_up.weight", (F, H), w_in),
            self.dense(p + "ffn_down.weight", (H, F), W_OUT),
        ]

    def moe(self, p: str, H: int, E: int, F: int, n_shared: int, bias: bool) -> list[TensorSpec]:
        """Router (F32; logits of std ~2), correction bias (sigmoid routing), routed and shared experts."""
        w_in, Fs = 1.0 / math.sqrt(H), n_shared * F
        specs = [spec(p + "ffn_gate_inp.weight", T.F32, (E, H), 2.0 * w_in, self.seed)]
        if bias:
            specs.append(uniform_spec(p + "exp_probs_b.bias", E, -0.1, 0.1, self.seed))
        specs += [
            self._spec(p + "ffn_gate_exps.weight", self.expert, (E, F, H), w_in),
            self._spec(p + "ffn_up_exps.weight", self.expert, (E, F, H), w_in),
            self._spec(p + "ffn_down_exps.weight", self.expert, (E, H, F), W_OUT),
        ]
        if n_shared:
            specs += [
                self._spec(p + "ffn_gate_shexp.weight", self.expert, (Fs, H), w_in),
                self._spec(p + "ffn_up_shexp.weight", self.expert, (Fs, H), w_in),
                self._spec(p + "ffn_down_shexp.weight", self.expert, (H, Fs), W_OUT),
            ]
        return specs


# Real dimensions from the public configs (config.json / transformers' config classes); see the module doc
ARCH_SHAPES: dict[str, DeepSeekShape | GlmShape] = {
    "deepseek-v2-lite": DeepSeekShape(
        n_layers=27, hidden=2048, n_heads=16, q_lora=0, kv_lora=512, qk_nope=128, qk_rope=64, v_head_dim=128,
        n_experts=64, top_k=6, expert_ffn=1408, n_shared=2, n_dense=1, dense_ffn=10944, gating=1,
        weights_norm=False, weights_scale=1.0, yarn_factor=40.0, mscale_all_dim=0.707,
    ),
    "deepseek-v3": DeepSeekShape(
        n_layers=61, hidden=7168, n_heads=128, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head_dim=128,
        n_experts=256, top_k=8, expert_ffn=2048, n_shared=1, n_dense=3, dense_ffn=18432, gating=2,
        weights_norm=True, weights_scale=2.5, n_group=8, topk_group=4, yarn_factor=40.0, mscale_all_dim=1.0,
    ),
    # Kimi-K2-Instruct-0905's rope (the first K2-Instruct had factor 32 and a 131072 context)
    "kimi-k2": DeepSeekShape(
        n_layers=61, hidden=7168, n_heads=64, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head_dim=128,
        n_experts=384, top_k=8, expert_ffn=2048, n_shared=1, n_dense=1, dense_ffn=18432, gating=2,
        weights_norm=True, weights_scale=2.827, context_length=262144, rope_theta=50_000.0, yarn_factor=64.0,
        yarn_beta_fast=1.0, yarn_beta_slow=1.0, mscale_all_dim=1.0,
    ),
    # GLM-5 / 5.1 (transformers' GlmMoeDsaConfig defaults: every block's indexer full) and DeepSeek-V3.2
    "glm-5": DeepSeekShape(
        n_layers=78, hidden=6144, n_heads=64, q_lora=2048, kv_lora=512, qk_nope=192, qk_rope=64, v_head_dim=256,
        n_experts=256, top_k=8, expert_ffn=2048, n_shared=1, n_dense=3, dense_ffn=12288, gating=2,
        weights_norm=True, weights_scale=2.5, context_length=202752, rms_eps=1e-5, arch="glm-dsa", index_heads=32,
    ),
    "deepseek-v3.2": DeepSeekShape(
        n_layers=61, hidden=7168, n_heads=128, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head_dim=128,
        n_experts=256, top_k=8, expert_ffn=2048, n_shared=1, n_dense=3, dense_ffn=18432, gating=2,
        weights_norm=True, weights_scale=2.5, n_group=8, topk_group=4, yarn_factor=40.0, mscale_all_dim=1.0,
        arch="deepseek32", index_heads=64,
    ),
    "glm-4.5-air": GlmShape(
        n_layers=46, hidden=4096, n_heads=96, n_kv_heads=8, head_dim=128, n_experts=128, top_k=8,
        expert_ffn=1408, n_shared=1, n_dense=1, dense_ffn=10944, qk_norm=False, weights_scale=1.0,
    ),
    "glm-4.6": GlmShape(
        n_layers=92, hidden=5120, n_heads=96, n_kv_heads=8, head_dim=128, n_experts=160, top_k=8,
        expert_ffn=1536, n_shared=1, n_dense=3, dense_ffn=12288, qk_norm=True, weights_scale=2.5,
        context_length=202752,
    ),
    # small ones of the same architectures, for tests and the llama.cpp check: V2-Lite's (no q LoRA, softmax,
    # two shared experts, experts whose rows fall back from K-quants) and V3's (q LoRA, sigmoid + bias, 4 groups
    # of which 2 are used, routed scale 2.5). llama.cpp tells a q-LoRA-less deepseek2 file (V2-Lite) by its 26
    # or 27 blocks, so tiny-deepseek2 keeps 27 and slices of deepseek-v2-lite load in moestream only.
    "tiny-deepseek2": DeepSeekShape(
        n_layers=27, hidden=256, n_heads=4, q_lora=0, kv_lora=128, qk_nope=64, qk_rope=32, v_head_dim=64,
        n_experts=8, top_k=3, expert_ffn=128, n_shared=2, n_dense=1, dense_ffn=256, gating=1,
        weights_norm=False, weights_scale=1.0, context_length=4096, yarn_factor=4.0, yarn_orig_ctx=1024,
        mscale_all_dim=0.707,
    ),
    "tiny-deepseek3": DeepSeekShape(
        n_layers=3, hidden=256, n_heads=4, q_lora=128, kv_lora=128, qk_nope=64, qk_rope=32, v_head_dim=64,
        n_experts=16, top_k=4, expert_ffn=256, n_shared=1, n_dense=1, dense_ffn=512, gating=2,
        weights_norm=True, weights_scale=2.5, n_group=4, topk_group=2, context_length=4096, yarn_factor=4.0,
        yarn_orig_ctx=1024, mscale_all_dim=1.0,
    ),
    "tiny-glm-dsa": DeepSeekShape(
        n_layers=4, hidden=256, n_heads=4, q_lora=128, kv_lora=128, qk_nope=64, qk_rope=32, v_head_dim=64,
        n_experts=16, top_k=4, expert_ffn=256, n_shared=1, n_dense=1, dense_ffn=512, gating=2, weights_norm=True,
        weights_scale=2.5, context_length=4096, rms_eps=1e-5, arch="glm-dsa", index_heads=8, index_dim=64,
        index_topk=16, index_full=(True, True, False, True),
    ),
    "tiny-glm4moe": GlmShape(
        n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=16, top_k=4, expert_ffn=256,
        n_shared=1, n_dense=1, dense_ffn=512, qk_norm=True, weights_scale=2.5, context_length=4096,
    ),
}  # fmt: skip
