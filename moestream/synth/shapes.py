"""Synthetic GGUF models at real shapes with random weights: qwen3moe and qwen35moe here, deepseek2
(DeepSeek-V2/V3, Kimi-K2) and glm4moe (GLM-4.5/4.6) in arches.py, gpt-oss, Mixtral, OLMoE, Qwen2-MoE and
MiniMax-M2 in gqa_arches.py, deepseek4 (DeepSeek-V4 Flash and Pro) in v4_arches.py.

They exercise the engine (and llama.cpp, for baselines) at full size without downloading anything:
same tensor names, shapes, types and expert layout as a converted GGUF of that model.

Speed matters (a Qwen3-30B-A3B shape is ~17 GB): quantized tensors are made directly as valid random
blocks (synth_blocks.py), so no float ever goes through a quantizer.

Scales: embeddings std 1, attention-out and expert-down std 0.002, so the residual stream stays dominated
by the current token's embedding, routing differs from token to token, and greedy decoding does not
collapse onto one token.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from moestream.formats.gguf_write import TensorSpec, write_gguf_parts
from moestream.formats.tokenizer import build_tiny_bpe_metadata
from moestream.synth.arches import ARCH_SHAPES, DeepSeekShape, GlmShape, llama_cpp_loads
from moestream.synth.blocks import header_table, norm_spec, random_blocks, spec, uniform_spec, use_more_bits
from moestream.synth.glm5_next_arches import GLM5_NEXT_SHAPES, Glm5NextShape
from moestream.synth.gqa_arches import GQA_SHAPES, GqaShape
from moestream.synth.v4_arches import V4_SHAPES, DeepSeek4Shape

__all__ = ["SHAPES", "QUANTS", "SynthShape", "header_table", "llama_cpp_loads", "q4_k_m_type", "random_blocks",
           "shape_metadata", "synth_nbytes", "synth_tensors", "use_more_bits", "write_synth",
           "write_synth_parts"]  # fmt: skip

ARCH = "qwen3moe"


@dataclass(frozen=True)
class SynthShape:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    dense_ffn: int  # qwen3moe.feed_forward_length: written by the converter, unused by MoE layers
    shared_ffn: int = 0  # > 0: one always-on shared expert per layer (ffn_*_shexp)
    context_length: int = 40960
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    vocab: int | None = None  # None: the size of the tiny BPE vocab written as the tokenizer
    arch: str = ARCH
    # qwen35moe only: Gated DeltaNet layers (all but every full_attention_interval-th), partial rotary
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_head_dim: int = 0  # key and value heads alike (llama.cpp's qwen35moe assumes so)
    conv_kernel: int = 4
    full_attention_interval: int = 4
    rot_dim: int = 0  # rotary dims per head; 0: all of head_dim

    def recurrent(self, layer: int) -> bool:
        return self.arch == "qwen35moe" and (layer + 1) % self.full_attention_interval != 0


SHAPES: dict[str, SynthShape | DeepSeekShape | GlmShape | GqaShape | DeepSeek4Shape] = {
    "tiny": SynthShape(
        n_layers=4,
        hidden=256,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        n_experts=16,
        top_k=4,
        expert_ffn=256,
        dense_ffn=768,
        context_length=4096,
    ),
    "qwen3-30b-a3b": SynthShape(
        n_layers=48,
        hidden=2048,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        n_experts=128,
        top_k=8,
        expert_ffn=768,
        dense_ffn=6144,
    ),
    # Qwen3.6-35B-A3B's MoE stack with full attention in every layer, so it stays qwen3moe-compatible
    "qwen3.6-35b-a3b-moe": SynthShape(
        n_layers=40,
        hidden=2048,
        n_heads=16,
        n_kv_heads=2,
        head_dim=256,
        n_experts=256,
        top_k=8,
        expert_ffn=512,
        dense_ffn=5120,
        shared_ffn=512,
        context_length=262144,
    ),
    # Qwen3.5/3.6-35B-A3B as it is (transformers' Qwen3_5MoeTextConfig defaults): 3 of 4 layers Gated DeltaNet
    # (16 key / 32 value heads of 128, conv 4), every 4th gated attention with rotary on 64 of 256 dims
    "qwen3.6-35b-a3b": SynthShape(
        n_layers=40,
        hidden=2048,
        n_heads=16,
        n_kv_heads=2,
        head_dim=256,
        n_experts=256,
        top_k=8,
        expert_ffn=512,
        dense_ffn=0,  # no dense FFN anywhere; the converter writes no feed_forward_length
        shared_ffn=512,
        context_length=262144,
        rope_theta=10_000_000.0,
        arch="qwen35moe",
        lin_k_heads=16,
        lin_v_heads=32,
        lin_head_dim=128,
        rot_dim=64,
    ),
    **ARCH_SHAPES,  # deepseek2 and glm4moe
    **GQA_SHAPES,  # gpt-oss, llama (Mixtral), olmoe, qwen2moe, minimax-m2
    **V4_SHAPES,  # deepseek4 (DeepSeek-V4 Flash and Pro)
    **GLM5_NEXT_SHAPES,  # glm5-next (GLM-5.3-Flash)
}

QUANTS: dict[str, T] = {
    "Q4_0": T.Q4_0,
    "Q8_0": T.Q8_0,
    "Q4_K": T.Q4_K,
    "Q4_K_M": T.Q4_K,  # Q4_K with llama.cpp's Q4_K_M exceptions in Q6_K and Q5_K (q4_k_m_type)
    "Q6_K": T.Q6_K,
    "F16": T.F16,
    "BF16": T.BF16,
    "F32": T.F32,
    "MXFP4": T.MXFP4,  # llama-quantize's MXFP4_MOE: experts MXFP4, the rest Q8_0 (gqa and deepseek4 shapes)
}
_FILE_TYPE = {
    T.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    T.Q4_K: LlamaFileType.MOSTLY_Q4_K_S,
    T.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    T.F16: LlamaFileType.MOSTLY_F16,
    T.BF16: LlamaFileType.MOSTLY_BF16,
    T.F32: LlamaFileType.ALL_F32,
    T.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
}


def q4_k_m_type(name: str, layer: int, n_layers: int) -> T:
    """The type llama-quantize (llama_tensor_get_type) gives a tensor of a Q4_K_M file, for the tensors a
    synthetic model has: the output head in Q6_K; ffn_down (experts and shared expert) in Q6_K on the layers
    use_more_bits picks; a fused attn_qkv (qwen35moe's DeltaNet input) in Q5_K; the rest Q4_K. Its attn_v rule
    (Q6_K on some layers, counted over attention layers) is left out: dense, small, and versions differ."""
    if name == "output.weight" or ("ffn_down" in name and use_more_bits(layer, n_layers)):
        return T.Q6_K
    if "attn_qkv" in name:
        return T.Q5_K
    return T.Q4_K


def shape_metadata(s: SynthShape, name: str, file_type: int) -> dict[str, Any]:
    """The general.* and <arch>.* keys llama.cpp's converter writes for this shape."""
    a = s.arch
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        f"{a}.block_count": s.n_layers,
        f"{a}.context_length": s.context_length,
        f"{a}.embedding_length": s.hidden,
        **({f"{a}.feed_forward_length": s.dense_ffn} if s.dense_ffn else {}),  # none in qwen35moe files
        f"{a}.attention.head_count": s.n_heads,
        f"{a}.attention.head_count_kv": s.n_kv_heads,
        f"{a}.attention.key_length": s.head_dim,
        f"{a}.attention.value_length": s.head_dim,
        f"{a}.rope.freq_base": float(s.rope_theta),
        f"{a}.attention.layer_norm_rms_epsilon": float(s.rms_eps),
        f"{a}.expert_count": s.n_experts,
        f"{a}.expert_used_count": s.top_k,
        f"{a}.expert_feed_forward_length": s.expert_ffn,
    }
    if s.shared_ffn:
        md[f"{a}.expert_shared_feed_forward_length"] = s.shared_ffn
    if a == "qwen35moe":
        md |= {
            f"{a}.ssm.conv_kernel": s.conv_kernel,
            f"{a}.ssm.state_size": s.lin_head_dim,
            f"{a}.ssm.group_count": s.lin_k_heads,
            f"{a}.ssm.time_step_rank": s.lin_v_heads,
            f"{a}.ssm.inner_size": s.lin_v_heads * s.lin_head_dim,
            f"{a}.attention.recurrent_layers": [s.recurrent(i) for i in range(s.n_layers)],
            f"{a}.full_attention_interval": s.full_attention_interval,
            f"{a}.rope.dimension_count": s.rot_dim or s.head_dim,
            f"{a}.rope.dimension_sections": [11, 11, 10, 0],  # MRoPE for images; text sees plain rotary
        }
    return md


def _deltanet_specs(s: SynthShape, p: str, dense_type: T, seed: int, qkv_type: T) -> list[TensorSpec]:
    """One Gated DeltaNet layer's token mixer, under llama.cpp's names and in its stored forms."""
    H, Hv, d, K = s.hidden, s.lin_v_heads, s.lin_head_dim, s.conv_kernel
    conv_dim = 2 * s.lin_k_heads * d + Hv * d
    w_in = 1.0 / math.sqrt(H)
    return [
        spec(p + "attn_qkv.weight", qkv_type, (conv_dim, H), w_in, seed),
        spec(p + "attn_gate.weight", dense_type, (Hv * d, H), w_in, seed),
        spec(p + "ssm_beta.weight", dense_type, (Hv, H), w_in, seed),
        spec(p + "ssm_alpha.weight", dense_type, (Hv, H), w_in, seed),
        # depthwise conv kernel, F32 as llama.cpp keeps it; std of nn.Conv1d's init for 4 taps
        spec(p + "ssm_conv1d.weight", T.F32, (conv_dim, K), 0.5 / math.sqrt(3), seed),
        uniform_spec(p + "ssm_dt.bias", Hv, 0.5, 1.5, seed),
        # -exp(A_log) with A uniform in (0.01, 16) as transformers initialises it: heads that forget within
        # a token next to heads that remember for hundreds
        uniform_spec(p + "ssm_a", Hv, -16.0, -0.01, seed),
        norm_spec(p + "ssm_norm.weight", d, seed),
        spec(p + "ssm_out.weight", dense_type, (H, Hv * d), 0.002, seed),
    ]


def synth_tensors(
    s: SynthShape, expert_type: T, dense_type: T, vocab: int, seed: int, k_m: bool = False
) -> list[TensorSpec]:
    """The tensors of a synthetic model. k_m: a Q4_K_M file (q4_k_m_type's Q6_K exceptions)."""

    def typed(name: str, default: T, layer: int = -1) -> T:
        return q4_k_m_type(name, layer, s.n_layers) if k_m else default

    H, q_dim, kv_dim = s.hidden, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    E, F, Fs = s.n_experts, s.expert_ffn, s.shared_ffn
    w_in = 1.0 / math.sqrt(H)  # input projections: unit-variance outputs from an RMS-normed input
    w_out = 0.002  # residual writers (attn_output, ffn_down): small, the embedding keeps dominating
    gated = s.arch == "qwen35moe"  # attn_q also yields a per-head output gate
    specs = [spec("token_embd.weight", dense_type, (vocab, H), 1.0, seed)]
    for i in range(s.n_layers):
        p = f"blk.{i}."
        specs.append(norm_spec(p + "attn_norm.weight", H, seed))
        if s.recurrent(i):
            specs += _deltanet_specs(s, p, dense_type, seed, typed("attn_qkv", dense_type))
        else:
            specs += [
                spec(p + "attn_q.weight", dense_type, ((2 if gated else 1) * q_dim, H), w_in, seed),
                spec(p + "attn_k.weight", dense_type, (kv_dim, H), w_in, seed),
                spec(p + "attn_v.weight", dense_type, (kv_dim, H), w_in, seed),
                spec(p + "attn_output.weight", dense_type, (H, q_dim), w_out, seed),
                norm_spec(p + "attn_q_norm.weight", s.head_dim, seed),
                norm_spec(p + "attn_k_norm.weight", s.head_dim, seed),
            ]
        specs += [
            # qwen35moe names the norm before the MoE after the attention it follows
            norm_spec(p + ("post_attention_norm.weight" if gated else "ffn_norm.weight"), H, seed),
            # router logits with std ~2: top-k sets differ between tokens, softmax is not one-hot
            spec(p + "ffn_gate_inp.weight", T.F32, (E, H), 2.0 * w_in, seed),
            spec(p + "ffn_gate_exps.weight", expert_type, (E, F, H), w_in, seed),
            spec(p + "ffn_up_exps.weight", expert_type, (E, F, H), w_in, seed),
            spec(p + "ffn_down_exps.weight", typed("ffn_down_exps", expert_type, i), (E, H, F), w_out, seed),
        ]
        if Fs:
            specs += [
                spec(p + "ffn_gate_shexp.weight", expert_type, (Fs, H), w_in, seed),
                spec(p + "ffn_up_shexp.weight", expert_type, (Fs, H), w_in, seed),
                spec(p + "ffn_down_shexp.weight", typed("ffn_down_shexp", expert_type, i), (H, Fs), w_out, seed),
            ]
            if gated:  # sigmoid gate on the shared expert: logits of std ~1
                specs.append(spec(p + "ffn_gate_inp_shexp.weight", T.F32, (1, H), w_in, seed))
    specs += [
        norm_spec("output_norm.weight", H, seed),
        spec("output.weight", typed("output.weight", dense_type), (vocab, H), 2.0 * w_in, seed),
    ]
    return specs


def _quant_type(name: str) -> T:
    try:
        return QUANTS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown quant {name!r}; choose one of {', '.join(QUANTS)}") from None


AnyShape = SynthShape | DeepSeekShape | GlmShape | GqaShape | DeepSeek4Shape | Glm5NextShape


def _resolve(shape: str, layers: int | None, quant: str | None = None, top_k: int | None = None) -> AnyShape:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    s = SHAPES[shape]
    if top_k is not None:  # a model run at another top-k than its own (expert_used_count), as traces are
        if not 1 <= top_k <= s.n_experts:
            raise ValueError(f"top-k must be between 1 and {s.n_experts} for {shape}, got {top_k}")
        s = replace(s, top_k=top_k)
    if quant is not None and quant.upper() == "MXFP4" and not isinstance(s, (GqaShape, DeepSeek4Shape)):
        gqa = ", ".join(n for n in [*GQA_SHAPES, *V4_SHAPES] if not n.startswith("tiny"))
        raise ValueError(f"MXFP4 is offered for the shapes {gqa} (and their tiny ones), not {shape}")
    if layers is None:
        return s
    low = getattr(s, "n_dense", 0) + 1  # a slice keeps at least one MoE block
    if not low <= layers <= s.n_layers:
        raise ValueError(f"layers must be between {low} and {s.n_layers} for {shape}, got {layers}")
    return replace(s, n_layers=layers)


def _specs(s: AnyShape, expert: T, dense: T, vocab: int, seed: int, k_m: bool) -> list[TensorSpec]:
    if isinstance(s, SynthShape):
        return synth_tensors(s, expert, dense, vocab, seed, k_m)
    return s.tensors(expert, dense, vocab, seed, k_m)


def _tokenizer_md(s: AnyShape) -> dict[str, Any]:
    return s.tokenizer_metadata() if isinstance(s, GqaShape) else build_tiny_bpe_metadata()


def shape_routing(shape: str, quant: str) -> dict[str, int]:
    """A shape's routing and sizes, without writing it: MoE layers, experts, top-k, bytes one expert reads
    (the mean over layers, as a Q4_K_M mix varies them) and every other byte (the resident part)."""
    s = _resolve(shape, None, quant)
    vocab = getattr(s, "vocab", None) or len(_tokenizer_md(s)["tokenizer.ggml.tokens"])
    specs = _specs(s, _quant_type(quant), _quant_type(quant), vocab, 0, quant.upper() == "Q4_K_M")
    experts = sum(t.nbytes for t in specs if "_exps." in t.name)
    moe_layers = s.n_layers - getattr(s, "n_dense", 0)
    return {
        "layers": moe_layers,
        "experts": s.n_experts,
        "top_k": s.top_k,
        "expert_bytes": round(experts / (moe_layers * s.n_experts)),
        "dense_bytes": sum(t.nbytes for t in specs) - experts,
    }


def synth_nbytes(shape: str, quant: str, layers: int | None = None, *, dense: str | None = None) -> int:
    """Bytes of tensor data write_synth would write (plus a header under 1 MB): for a disk-space check."""
    s = _resolve(shape, layers, quant)
    vocab = getattr(s, "vocab", None) or len(_tokenizer_md(s)["tokenizer.ggml.tokens"])
    specs = _specs(s, _quant_type(quant), _quant_type(dense or quant), vocab, 0, quant.upper() == "Q4_K_M")
    return sum(t.nbytes for t in specs)


def write_synth(
    shape: str,
    quant: str,
    path: str | os.PathLike[str],
    layers: int | None = None,
    seed: int = 0,
    progress: bool = True,
    *,
    dense: str | None = None,
    split_max_size: int = 0,
    top_k: int | None = None,
) -> str:
    """Write a random-weight GGUF of a named shape; returns the path (of a split model: its first part)."""
    parts = write_synth_parts(
        shape, quant, path, layers, seed, progress, dense=dense, split_max_size=split_max_size, top_k=top_k
    )
    return parts[0]


def write_synth_parts(
    shape: str,
    quant: str,
    path: str | os.PathLike[str],
    layers: int | None = None,
    seed: int = 0,
    progress: bool = True,
    *,
    dense: str | None = None,
    split_max_size: int = 0,
    top_k: int | None = None,
) -> list[str]:
    """Write a random-weight GGUF of a named shape; returns the files written (a split model's parts, with
    split_max_size: write_gguf_parts).

    quant: type of the expert tensors ('Q4_0', 'Q8_0', 'Q4_K', 'Q6_K', 'F16', also 'BF16', 'F32'), or 'Q4_K_M':
    Q4_K with llama.cpp's Q4_K_M exceptions (q4_k_m_type; synth_arches.q4_k_m_type for deepseek2/glm4moe,
    synth_gqa_arches.q4_k_m_type for the gqa shapes), or 'MXFP4' (gqa shapes: llama-quantize's MXFP4_MOE).
    gpt-oss shapes keep their experts MXFP4 in every quantized mix, as the published files do.
    dense: type of the embeddings, attention and output weights; default the same as `quant`, as
    llama-quantize does. Norms and the router stay F32 (the converter keeps ffn_gate_inp in F32).
    layers: keep only the first N layers (a quick model of the same per-layer shape); for deepseek2 and
    glm4moe N counts every block, the leading dense ones included (glm4moe's nextn block comes after them).
    top_k: the experts each token routes to (expert_used_count), if not the shape's own.
    """
    s = _resolve(shape, layers, quant, top_k)
    expert_type = _quant_type(quant)
    dense_type = _quant_type(dense or quant)
    tok_md = _tokenizer_md(s)
    vocab = getattr(s, "vocab", None) or len(tok_md["tokenizer.ggml.tokens"])
    if vocab != len(tok_md["tokenizer.ggml.tokens"]):
        raise ValueError(f"{shape} wants vocab {vocab} but the tokenizer has {len(tok_md['tokenizer.ggml.tokens'])}")
    name = f"moestream-synth-{shape}-{quant.upper()}" + (f"-{layers}L" if layers is not None else "")
    name += f"-top{top_k}" if top_k is not None else ""
    k_m = quant.upper() == "Q4_K_M"
    file_type = LlamaFileType.MOSTLY_Q4_K_M if k_m else _FILE_TYPE[expert_type]
    if isinstance(s, SynthShape):
        md = shape_metadata(s, name, file_type)
    else:
        md = s.metadata(name, file_type, vocab)
    specs = _specs(s, expert_type, dense_type, vocab, seed, k_m)
    return write_gguf_parts(
        path, s.arch, md | tok_md, specs, progress=progress, desc=name, split_max_size=split_max_size
    )
