"""Tiny random GPT-OSS models (transformers) written as llama.cpp's converter writes gpt-oss files (GptOssModel),
experts optionally in MXFP4 as the openai checkpoints hold them; tests/hf_gguf.py holds the shared helpers.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from moestream.formats.gguf_write import array_tensor
from tests.hf_gguf import (
    _FILE_TYPE,
    E2M1,
    TinyArch,
    _f32,
    _f32_spec,
    _rope_theta,
    _types,
    _weight,
    _write,
    tiny_vocab_size,
)


def tiny_gpt_oss_config(**overrides: Any):
    """A small GptOssConfig: sliding window (even layers) shorter than the test prompts, YaRN over a short
    original context so that its interpolation shows within a hundred positions.

    llama.cpp rounds YaRN's ramp ends outwards to whole dims; GPT-OSS's reference does not (truncate false).
    This theta puts the ramp on 0 .. 5.9994, where the two agree, so the llama.cpp comparison checks the
    rest of the graph; test_gpt_oss checks the unrounded ramp against transformers with the real config."""
    from transformers import GptOssConfig

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=24,
        max_position_embeddings=256,  # the original context times the YaRN factor
        rope_parameters={"rope_type": "yarn", "rope_theta": 238_000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        rms_norm_eps=1e-5,
        attention_bias=True,
        tie_word_embeddings=False,
    )  # fmt: skip
    kw.update(overrides)
    cfg = GptOssConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def gpt_oss_metadata(cfg: Any, name: str = "tiny-gpt-oss", file_type: int = 0) -> dict[str, Any]:
    """The general.* and gpt-oss.* keys convert_hf_to_gguf.py (GptOssModel and the TextModel base) writes."""
    a = "gpt-oss."
    rope = cfg.rope_parameters
    return {
        "general.architecture": "gpt-oss",
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        a + "block_count": cfg.num_hidden_layers,
        a + "context_length": cfg.max_position_embeddings,
        a + "embedding_length": cfg.hidden_size,
        a + "feed_forward_length": cfg.intermediate_size,
        a + "attention.head_count": cfg.num_attention_heads,
        a + "attention.head_count_kv": cfg.num_key_value_heads,
        a + "rope.freq_base": _rope_theta(cfg),
        a + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        a + "expert_count": cfg.num_local_experts,
        a + "expert_used_count": cfg.num_experts_per_tok,
        a + "attention.key_length": cfg.head_dim,
        a + "attention.value_length": cfg.head_dim,
        a + "attention.sliding_window": cfg.sliding_window,
        a + "expert_feed_forward_length": cfg.intermediate_size,
        a + "rope.scaling.type": "yarn",
        a + "rope.scaling.factor": float(rope["factor"]),
        a + "rope.scaling.original_context_length": int(rope.get("original_max_position_embeddings", 4096)),
    }


def mxfp4_checkpoint(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., K] -> the openai/gpt-oss checkpoint's (blocks uint8 [..., K/32, 16], scales uint8
    [..., K/32]): per 32 values one e8m0 exponent (bias 127) and 32 e2m1 codes, two to a byte, the even
    value in the low nibble. The scale makes the block's largest magnitude land at or below 6."""
    *lead, k = w.shape
    g = w.reshape(*lead, k // 32, 32).astype(np.float32)
    amax = np.abs(g).max(axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).clip(-127, 127)
    scaled = g / np.exp2(exp)[..., None]
    codes = np.abs(scaled[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exp + 127).astype(np.uint8)


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The converter's repack_mxfp4: checkpoint blocks [..., G, 16] (pairs in a byte) and scales [..., G] ->
    GGUF MXFP4 bytes [..., G * 17]: the scale byte, then value j in the low nibble of byte j and value
    j + 16 in its high nibble (the same e8m0 byte: ggml's table is doubled and its exponent bias 128)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """What the checkpoint holds as floats, [..., G * 32] (transformers' convert_moe_packed_tensors)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = E2M1[codes] * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


def quantize_gpt_oss_experts(model: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Round every expert matrix of a float GptOssForCausalLM to MXFP4 as the released checkpoints store it:
    the model's weights become exactly the values the blocks hold; returns the blocks and scales by the
    checkpoint's names (`...experts.gate_up_proj` -> [E, 2F, H/32, 16] and [E, 2F, H/32], rows = outputs)."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = _f32(p.transpose(-1, -2))  # [E, out, in], as the checkpoint lays them out
            blocks, scales = mxfp4_checkpoint(rows)
            vals = mxfp4_values(blocks, scales).reshape(rows.shape)
            with torch.no_grad():
                p.copy_(torch.from_numpy(vals).transpose(-1, -2))
            out[name] = (blocks, scales)
    return out


def write_gpt_oss_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
    mxfp4: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> None:
    """Write `model` (transformers GptOssForCausalLM) as a gpt-oss GGUF with the converter's names: the
    sinks as attn_sinks.weight, the router as ffn_gate_inp (weight and bias), gate_up_proj's interleaved rows
    (gate even, up odd) split into ffn_gate_exps / ffn_up_exps [E, F, H] and their biases [E, F], down_proj
    transposed to ffn_down_exps [E, H, F]. 1-D tensors, the router and every bias stay F32. mxfp4: the
    checkpoint's blocks and scales (quantize_gpt_oss_experts), repacked into MXFP4 tensors as the converter
    does, instead of expert_type."""
    cfg = model.config
    dense_t, expert_t = _types(dense_type, expert_type)
    sd = dict(model.state_dict())
    specs = [_weight("token_embd.weight", sd["model.embed_tokens.weight"], dense_t)]

    def experts(name: str, rows: torch.Tensor | np.ndarray) -> None:
        specs.append(_weight(name, rows, expert_t))

    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        at, ex = hf + "self_attn.", hf + "mlp.experts."
        specs.append(_f32_spec(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"]))
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):  # fmt: skip
            specs.append(_weight(f"{p}{ours}.weight", sd[f"{at}{theirs}.weight"], dense_t))
            specs.append(_f32_spec(f"{p}{ours}.bias", sd[f"{at}{theirs}.bias"]))
        specs.append(_f32_spec(p + "attn_sinks.weight", sd[at + "sinks"]))
        specs.append(_f32_spec(p + "post_attention_norm.weight", sd[hf + "post_attention_layernorm.weight"]))
        specs.append(_f32_spec(p + "ffn_gate_inp.weight", sd[hf + "mlp.router.weight"]))
        specs.append(_f32_spec(p + "ffn_gate_inp.bias", sd[hf + "mlp.router.bias"]))
        if mxfp4 is not None:
            blocks, scales = mxfp4[ex + "gate_up_proj"]
            packed = mxfp4_to_ggml(blocks, scales)  # [E, 2F, H/32*17]
            down = mxfp4_to_ggml(*mxfp4[ex + "down_proj"])
            for w, rows in (("gate", packed[:, 0::2]), ("up", packed[:, 1::2]), ("down", down)):
                shape = (*rows.shape[:-1], rows.shape[-1] // 17 * 32)
                specs.append(array_tensor(f"{p}ffn_{w}_exps.weight", T.MXFP4, shape, np.ascontiguousarray(rows)))
        else:
            gate_up = sd[ex + "gate_up_proj"].transpose(-1, -2)  # [E, 2F, H]
            experts(p + "ffn_gate_exps.weight", gate_up[:, 0::2])
            experts(p + "ffn_up_exps.weight", gate_up[:, 1::2])
            experts(p + "ffn_down_exps.weight", sd[ex + "down_proj"].transpose(-1, -2))
        bias = sd[ex + "gate_up_proj_bias"]
        specs.append(_f32_spec(p + "ffn_gate_exps.bias", bias[:, 0::2]))
        specs.append(_f32_spec(p + "ffn_up_exps.bias", bias[:, 1::2]))
        specs.append(_f32_spec(p + "ffn_down_exps.bias", sd[ex + "down_proj_bias"]))
    specs.append(_f32_spec("output_norm.weight", sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        specs.append(_weight("output.weight", sd["lm_head.weight"], dense_t))
    file_type = LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4 is not None else _FILE_TYPE.get(expert_t, 0)
    _write(path, "gpt-oss", gpt_oss_metadata(cfg, file_type=file_type), specs, cfg.vocab_size, tokenizer_md)


def _expected_gpt_oss(c: Any) -> dict[str, Any]:
    return {"n_layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab_size": c.vocab_size,
            "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "n_experts": c.num_local_experts, "top_k": c.num_experts_per_tok, "expert_ffn": c.intermediate_size,
            "sliding_window": c.sliding_window, "rms_eps": c.rms_norm_eps,
            "rope_theta": c.rope_parameters["rope_theta"], "yarn_factor": c.rope_parameters["factor"],
            "yarn_orig_ctx": c.rope_parameters["original_max_position_embeddings"]}  # fmt: skip


def _perturb_gpt_oss(model: Any) -> None:
    """Distinct norms; sinks, biases and routers that matter: the gate/up biases push a good share of the
    activations past the SwiGLU's clamp at 7 (both sides for up, above for gate)."""
    for name, p in model.named_parameters():
        if name.endswith("gate_up_proj_bias"):
            p.normal_(0.0, 6.0)
        elif name.endswith(("down_proj_bias", "proj.bias", "router.bias")):
            p.normal_(0.0, 0.5)
        elif name.endswith("sinks"):
            p.normal_(0.0, 1.0)
        elif p.ndim == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith("router.weight"):
            p.normal_(0.0, 0.3)
        elif name.endswith(("gate_up_proj", "down_proj")):
            p.normal_(0.0, 0.05)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            p.normal_(0.0, 0.1)  # sharp attention: where each key sits (rope, window) shows in the output


GPT_OSS = TinyArch("gpt-oss", "GptOssForCausalLM", tiny_gpt_oss_config, write_gpt_oss_from_hf, _perturb_gpt_oss,
                   ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_gpt_oss)  # fmt: skip


# gpt-oss-20b/120b's rope_scaling: the ramp's ends (8.09 and 17.4 dims) are not whole numbers
REAL_ROPE = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip

# the held-out check's shape (issue 39): head_dim 32 with more query heads than the hidden size holds, a
# window of 8, 16 experts top-4, the real checkpoints' YaRN
SHARP = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
             head_dim=32, num_local_experts=16, num_experts_per_tok=4, sliding_window=8, rope_parameters=REAL_ROPE,
             max_position_embeddings=131072)  # fmt: skip


def sharp_gpt_oss(seed: int) -> Any:
    """A GPT-OSS of the SHARP shape whose every bias and sink is N(0, 1) and whose q/k weights are large: keys
    far from zero and heads that attend to one or two positions, where how finely the KV cache holds a key
    moves the output."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(tiny_gpt_oss_config(**SHARP)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate_up_proj_bias"):
                p.normal_(0.0, 6.0)  # past the clamp at 7 for a good share of gate values
            elif "bias" in name or name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif p.ndim == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 0.1)
    return model
