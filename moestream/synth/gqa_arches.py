"""Synthetic gpt-oss (gpt-oss-20b/120b), llama-with-experts (Mixtral 8x7B), olmoe (OLMoE-1B-7B), qwen2moe
(Qwen2-57B-A14B) and minimax-m2 (MiniMax-M2) models at real shapes.

Tensors, shapes and metadata keys are those llama.cpp's convert_hf_to_gguf.py writes (GptOssModel,
LlamaModel, OlmoeModel, Qwen2MoeModel, MiniMaxM2Model), with random weights as synth.py makes them. Every 1-D
tensor, every bias, the routers, MiniMax-M2's correction bias and Qwen2-MoE's shared-expert gate stay F32, as
the converter keeps them. The vocabulary is
synth's tiny BPE one; gpt-oss shapes add harmony's control tokens and a compact harmony chat template, so
their answers split into channels as a real gpt-oss file's do.

GPT-OSS experts are MXFP4 whatever the mix, as every published gpt-oss GGUF has them: the converter repacks
the checkpoint's MXFP4 blocks as they are, and llama-quantize refuses to requantize them (the quants on
offer change only the other tensors). F32/F16/BF16 are the exception, modelling a conversion of the
bf16-upcast checkpoint: there the experts are floats too. `MXFP4` as the mix is llama-quantize's MXFP4_MOE:
3-D expert tensors MXFP4, every other quantizable tensor (output included) Q8_0, for any of these shapes.

Q4_K_M follows llama-quantize (llama_tensor_get_type): output in Q6_K; ffn_down (routed and shared) and
attn_v in Q6_K on the layers use_more_bits picks; with exactly 8 experts (Mixtral) attn_v and attn_k in
Q8_0 and attn_output in Q5_K; the rest Q4_K; then fit_rows' fallback for rows that are not whole 256-blocks:
gpt-oss's 2880-wide rows take Q5_0 for Q4_K and Q8_0 for Q6_K, so a Q4_K_M gpt-oss is MXFP4 experts
around Q5_0/Q8_0 dense weights, as the published ones are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType as T

from moestream.formats.gguf_write import TensorSpec
from moestream.formats.tokenizer import CONTROL, build_tiny_bpe_metadata
from moestream.synth.blocks import fit_rows, norm_spec, spec, uniform_spec, use_more_bits

W_OUT = 0.002  # residual writers (attn_output, ffn_down): small, the embedding keeps dominating
FLOATS = (T.F32, T.F16, T.BF16)

HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>")

# Harmony as gpt-oss's template writes it, compactly: the system message (reasoning effort, channels), a
# developer message with the instructions and the tools as a TypeScript-like namespace, then the turns;
# assistant tool calls go to the commentary channel addressed `to=functions.NAME`, results come back from
# `functions.NAME`, and an answer's reasoning is kept only while the turn has no final answer yet.
HARMONY_TEMPLATE = """\
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' -%}
{{- '<|start|>system<|message|>Reasoning: ' + effort + '\\n\\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools %}{{ "\\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif -%}
{{- '<|end|>' -}}
{%- set ns = namespace(first=0, call='') -%}
{%- if messages and messages[0].role in ('system', 'developer') %}{% set ns.first = 1 %}{% endif -%}
{%- if ns.first or tools -%}
{{- '<|start|>developer<|message|>' -}}
{%- if ns.first %}{{ '# Instructions\\n\\n' + messages[0].content }}{% if tools %}{{ '\\n\\n' }}{% endif %}{% endif -%}
{%- if tools -%}
{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' -}}
{%- for t in tools -%}
{{- '// ' + (t.function.description or '') + '\\ntype ' + t.function.name + ' = (_: ' -}}
{{- t.function.parameters | tojson -}}
{{- ') => any;\\n\\n' -}}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- for m in messages[ns.first:] -%}
{%- if m.role == 'user' -%}
{{- '<|start|>user<|message|>' + (m.content or '') + '<|end|>' -}}
{%- elif m.role == 'assistant' and m.tool_calls -%}
{%- if m.thinking %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{% endif -%}
{%- for c in m.tool_calls -%}
{%- set f = c.function if c.function is defined else c -%}
{%- set ns.call = f.name -%}
{{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>' -}}
{%- if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif -%}
{{- '<|call|>' -}}
{%- endfor -%}
{%- elif m.role == 'assistant' -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' -}}
{%- elif m.role == 'tool' -%}
{{- '<|start|>functions.' + ns.call + ' to=assistant<|channel|>commentary<|message|>' -}}
{{- m.content | tojson -}}
{{- '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif -%}
"""


def harmony_tokenizer_metadata() -> dict[str, Any]:
    """synth's tiny BPE vocabulary plus harmony's control tokens, EOS <|return|>, and HARMONY_TEMPLATE."""
    md = build_tiny_bpe_metadata()
    tokens = list(md["tokenizer.ggml.tokens"]) + list(HARMONY_TOKENS)
    types = list(md["tokenizer.ggml.token_type"]) + [CONTROL] * len(HARMONY_TOKENS)
    return md | {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.eos_token_id": tokens.index("<|return|>"),
        "tokenizer.chat_template": HARMONY_TEMPLATE,
    }


@dataclass(frozen=True)
class GqaShape:
    arch: str  # "gpt-oss", "llama" (Mixtral), "olmoe", "qwen2moe" or "minimax-m2"
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    dense_ffn: int  # <arch>.feed_forward_length as the converter writes it (the config's intermediate_size)
    shared_ffn: int = 0  # qwen2moe: the shared expert's rows
    context_length: int = 4096
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-5
    sliding_window: int = 0  # gpt-oss: the even layers' window
    yarn_factor: float = 0.0  # gpt-oss: rope scaling (always yarn)
    yarn_orig_ctx: int = 4096
    rot_dim: int = 0  # minimax-m2: the rotated dims at the start of each head (its rotary_dim)

    def tokenizer_metadata(self) -> dict[str, Any]:
        return harmony_tokenizer_metadata() if self.arch == "gpt-oss" else build_tiny_bpe_metadata()

    def metadata(self, name: str, file_type: int, vocab: int) -> dict[str, Any]:
        """The general.* and <arch>.* keys the converter writes (TextModel's, then the arch's own)."""
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
            a + "attention.head_count_kv": self.n_kv_heads,
            a + "rope.freq_base": float(self.rope_theta),
            a + "attention.layer_norm_rms_epsilon": float(self.rms_eps),
            a + "expert_count": self.n_experts,
            a + "expert_used_count": self.top_k,
        }
        if self.arch == "llama":
            md |= {a + "vocab_size": vocab, a + "rope.dimension_count": self.head_dim}
        elif self.arch == "qwen2moe":
            md |= {
                a + "expert_feed_forward_length": self.expert_ffn,
                a + "expert_shared_feed_forward_length": self.shared_ffn,
            }
        elif self.arch == "gpt-oss":  # head_dim is in its config.json, so the base writes key/value lengths
            md |= {
                a + "attention.key_length": self.head_dim,
                a + "attention.value_length": self.head_dim,
                a + "attention.sliding_window": self.sliding_window,
                a + "expert_feed_forward_length": self.expert_ffn,
                a + "rope.scaling.type": "yarn",
                a + "rope.scaling.factor": float(self.yarn_factor),
                a + "rope.scaling.original_context_length": self.yarn_orig_ctx,
            }
        elif self.arch == "minimax-m2":  # head_dim and scoring_func "sigmoid" are in its config.json
            md |= {
                a + "expert_gating_func": 2,
                a + "attention.key_length": self.head_dim,
                a + "attention.value_length": self.head_dim,
                a + "expert_feed_forward_length": self.expert_ffn,
                a + "rope.dimension_count": self.rot_dim,
            }
        return md

    def tensors(self, expert_type: T, dense_type: T, vocab: int, seed: int, k_m: bool = False) -> list[TensorSpec]:
        """Every tensor, in the converter's order within a block. k_m: a Q4_K_M file (q4_k_m_type)."""
        H, D, E, F = self.hidden, self.head_dim, self.n_experts, self.expert_ffn
        q_dim, kv_dim, w_in = self.n_heads * D, self.n_kv_heads * D, 1.0 / math.sqrt(H)
        oss = self.arch == "gpt-oss"
        if oss and expert_type not in FLOATS:
            expert_type = T.MXFP4
        q = _Typer(self, expert_type, dense_type, k_m, seed)
        specs = [q.dense("token_embd.weight", (vocab, H), 1.0)]
        for i in range(self.n_layers):
            p = f"blk.{i}."
            specs += [
                norm_spec(p + "attn_norm.weight", H, seed),
                q.dense(p + "attn_q.weight", (q_dim, H), w_in),
                *q.bias(p + "attn_q.bias", q_dim, oss or self.arch == "qwen2moe"),
                q.dense(p + "attn_k.weight", (kv_dim, H), w_in),
                *q.bias(p + "attn_k.bias", kv_dim, oss or self.arch == "qwen2moe"),
                q.dense(p + "attn_v.weight", (kv_dim, H), w_in),
                *q.bias(p + "attn_v.bias", kv_dim, oss or self.arch == "qwen2moe"),
                q.dense(p + "attn_output.weight", (H, q_dim), W_OUT),
                *q.bias(p + "attn_output.bias", H, oss, W_OUT),
            ]
            if self.arch in ("olmoe", "minimax-m2"):  # one norm over the whole projection, not per head
                specs += [
                    norm_spec(p + "attn_q_norm.weight", q_dim, seed),
                    norm_spec(p + "attn_k_norm.weight", kv_dim, seed),
                ]
            if oss:  # a learned logit per head that joins each softmax's denominator
                specs.append(uniform_spec(p + "attn_sinks.weight", self.n_heads, -1.0, 1.0, seed))
            specs += [
                norm_spec(p + ("post_attention_norm.weight" if oss else "ffn_norm.weight"), H, seed),
                # router logits with std ~2: top-k sets differ between tokens, softmax is not one-hot
                spec(p + "ffn_gate_inp.weight", T.F32, (E, H), 2.0 * w_in, seed),
                *q.bias(p + "ffn_gate_inp.bias", E, oss),
                # the correction bias (within +-0.1 of the sigmoid scores): it moves close choices
                *q.bias(p + "exp_probs_b.bias", E, self.arch == "minimax-m2"),
                q.expert(p + "ffn_gate_exps.weight", (E, F, H), w_in),
                *q.bias2(p + "ffn_gate_exps.bias", (E, F), oss, 0.1),
                q.expert(p + "ffn_up_exps.weight", (E, F, H), w_in),
                *q.bias2(p + "ffn_up_exps.bias", (E, F), oss, 0.1),
                q.expert(p + "ffn_down_exps.weight", (E, H, F), W_OUT),
                *q.bias2(p + "ffn_down_exps.bias", (E, H), oss, W_OUT),
            ]
            if self.shared_ffn:  # qwen2moe: the shared expert and its sigmoid gate (logits of std ~1)
                Fs = self.shared_ffn
                specs += [
                    spec(p + "ffn_gate_inp_shexp.weight", T.F32, (1, H), w_in, seed),
                    q.dense(p + "ffn_gate_shexp.weight", (Fs, H), w_in),
                    q.dense(p + "ffn_up_shexp.weight", (Fs, H), w_in),
                    q.dense(p + "ffn_down_shexp.weight", (H, Fs), W_OUT),
                ]
        specs += [norm_spec("output_norm.weight", H, seed), q.dense("output.weight", (vocab, H), 2.0 * w_in)]
        return specs


def q4_k_m_type(name: str, layer: int, s: GqaShape) -> T:
    """llama-quantize's wanted type for a tensor of a Q4_K_M file of these archs, before fit_rows."""
    more = use_more_bits(layer, s.n_layers)
    eight = s.n_experts == 8  # llama.cpp's Mixtral rules
    if name == "output.weight":
        return T.Q6_K
    if "attn_v.weight" in name or "attn_k.weight" in name:
        return T.Q8_0 if eight else T.Q6_K if "attn_v" in name and more else T.Q4_K
    if "attn_output.weight" in name and eight:
        return T.Q5_K
    if "ffn_down" in name and more:
        return T.Q6_K
    return T.Q4_K


def mxfp4_moe_type(shape: tuple[int, ...]) -> T:
    """llama-quantize's MXFP4_MOE: 3-D (expert) tensors MXFP4, the rest Q8_0."""
    return T.MXFP4 if len(shape) == 3 else T.Q8_0


class _Typer:
    """Makes each tensor's spec in the type the file's quant mix gives it."""

    def __init__(self, s: GqaShape, expert: T, dense: T, k_m: bool, seed: int):
        self.s, self.expert_t, self.dense_t, self.k_m, self.seed = s, expert, dense, k_m, seed

    def _spec(self, name: str, default: T, shape: tuple[int, ...], std: float) -> TensorSpec:
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        t = q4_k_m_type(name, layer, self.s) if self.k_m and default not in (T.MXFP4, *FLOATS) else default
        return spec(name, fit_rows(t, shape[-1]), shape, std, self.seed)

    def dense(self, name: str, shape: tuple[int, ...], std: float) -> TensorSpec:
        t = mxfp4_moe_type(shape) if self.dense_t == T.MXFP4 else self.dense_t
        return self._spec(name, t, shape, std)

    def expert(self, name: str, shape: tuple[int, ...], std: float) -> TensorSpec:
        return self._spec(name, self.expert_t, shape, std)

    def bias(self, name: str, n: int, present: bool, scale: float = 0.1) -> list[TensorSpec]:
        return [uniform_spec(name, n, -scale, scale, self.seed)] if present else []

    def bias2(self, name: str, shape: tuple[int, int], present: bool, scale: float) -> list[TensorSpec]:
        """A 2-D bias (one row per expert), F32 as the converter keeps every bias."""
        return [spec(name, T.F32, shape, scale / math.sqrt(3.0), self.seed)] if present else []


# Real dimensions from the public config.json files (module doc); tiny-* are small ones of the same
# architectures for tests and the llama.cpp check (8 experts for Mixtral keeps llama.cpp's Mixtral rules;
# OLMoE keeps kv heads = heads, the only k_norm width llama.cpp's olmoe takes).
GQA_SHAPES: dict[str, GqaShape] = {
    "gpt-oss-20b": GqaShape(
        "gpt-oss", n_layers=24, hidden=2880, n_heads=64, n_kv_heads=8, head_dim=64, n_experts=32, top_k=4,
        expert_ffn=2880, dense_ffn=2880, context_length=131072, rope_theta=150_000.0, sliding_window=128,
        yarn_factor=32.0,
    ),
    "gpt-oss-120b": GqaShape(
        "gpt-oss", n_layers=36, hidden=2880, n_heads=64, n_kv_heads=8, head_dim=64, n_experts=128, top_k=4,
        expert_ffn=2880, dense_ffn=2880, context_length=131072, rope_theta=150_000.0, sliding_window=128,
        yarn_factor=32.0,
    ),
    "mixtral-8x7b": GqaShape(
        "llama", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, n_experts=8, top_k=2,
        expert_ffn=14336, dense_ffn=14336, context_length=32768, rope_theta=1_000_000.0,
    ),
    "olmoe-1b-7b": GqaShape(
        "olmoe", n_layers=16, hidden=2048, n_heads=16, n_kv_heads=16, head_dim=128, n_experts=64, top_k=8,
        expert_ffn=1024, dense_ffn=1024,
    ),
    "qwen2-57b-a14b": GqaShape(
        "qwen2moe", n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, head_dim=128, n_experts=64, top_k=8,
        expert_ffn=2560, dense_ffn=18944, shared_ffn=20480, context_length=32768, rope_theta=1_000_000.0,
        rms_eps=1e-6,
    ),
    # YaRN over a short original context with a theta that puts the ramp's ends on whole dims, where
    # llama.cpp's rounding of them and GPT-OSS's unrounded ramp agree; the window is shorter than a prompt
    "minimax-m2": GqaShape(
        "minimax-m2", n_layers=62, hidden=3072, n_heads=48, n_kv_heads=8, head_dim=128, n_experts=256, top_k=8,
        expert_ffn=1536, dense_ffn=1536, context_length=196608, rope_theta=5_000_000.0, rms_eps=1e-6, rot_dim=64,
    ),
    "tiny-gpt-oss": GqaShape(
        "gpt-oss", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, top_k=2,
        expert_ffn=256, dense_ffn=256, context_length=256, rope_theta=238_000.0, sliding_window=24,
        yarn_factor=4.0, yarn_orig_ctx=64,
    ),
    "tiny-mixtral": GqaShape(
        "llama", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, top_k=2,
        expert_ffn=512, dense_ffn=512, rope_theta=1_000_000.0,
    ),
    "tiny-olmoe": GqaShape(
        "olmoe", n_layers=3, hidden=256, n_heads=4, n_kv_heads=4, head_dim=64, n_experts=16, top_k=4,
        expert_ffn=256, dense_ffn=256,
    ),
    "tiny-minimax-m2": GqaShape(
        "minimax-m2", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=16, top_k=4,
        expert_ffn=256, dense_ffn=256, rope_theta=5_000_000.0, rms_eps=1e-6, rot_dim=32,
    ),
    "tiny-qwen2moe": GqaShape(
        "qwen2moe", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=16, top_k=4,
        expert_ffn=256, dense_ffn=512, shared_ffn=512, rope_theta=1_000_000.0, rms_eps=1e-6,
    ),
}  # fmt: skip
