"""Tiny random MiniMax-M2 models (transformers `minimax_m2`) written as llama.cpp's converter writes minimax-m2
files (conversion/minimax.py's MiniMaxM2Model on the TextModel base): no q/k permutation (NeoX rope), the
q/k norms over the whole projections (`attn_q_norm` [n_heads x head_dim], `attn_k_norm` [n_kv x head_dim]),
the expert gate/up/down stacked into [E, rows, cols], the correction bias as `exp_probs_b.bias`; 1-D tensors,
norms and the router in F32. Keys: the base's (with expert_gating_func from the config's scoring_func, and
key/value_length from head_dim) plus expert_feed_forward_length and rope.dimension_count (the config's
rotary_dim; both fields are what the converter needs in config.json, and transformers does not write them).
tests/hf_gguf.py holds the shared helpers.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from tests.hf_gguf import (
    _FILE_TYPE,
    TinyArch,
    _experts,
    _f32_spec,
    _rope_theta,
    _types,
    _weight,
    _write,
    tiny_vocab_size,
)

ARCH = "minimax-m2"
SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID
ATTN = (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj"))


def tiny_minimax_m2_config(**overrides: Any):
    """A small MiniMaxM2Config shaped like MiniMax-M2: GQA 4/2 heads of 64 with half of each head rotated
    (rotary_dim 32 of 64, as 64 of 128), whole-projection q/k norms, sigmoid routing with a correction bias."""
    from transformers import MiniMaxM2Config

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
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,  # the real ids (200034, 200020) lie outside the tiny vocabulary
        eos_token_id=None,
    )
    return MiniMaxM2Config(**(kw | overrides))


def rotary_dim(cfg: Any) -> int:
    return int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))


def minimax_m2_metadata(cfg: Any, name: str = "tiny-minimax-m2", file_type: int = 0) -> dict[str, Any]:
    """The general.* and minimax-m2.* keys the converter writes for a config.json with rotary_dim and
    scoring_func "sigmoid"."""
    a = ARCH + "."
    return {
        "general.architecture": ARCH,
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
        a + "expert_gating_func": SIGMOID,
        a + "attention.key_length": cfg.head_dim,
        a + "attention.value_length": cfg.head_dim,
        a + "expert_feed_forward_length": cfg.intermediate_size,
        a + "rope.dimension_count": rotary_dim(cfg),
    }


def write_minimax_m2_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
) -> None:
    """Write `model` (transformers MiniMaxM2ForCausalLM) as a minimax-m2 GGUF, in the converter's tensor
    order (per block: attention, norms, router, correction bias, experts)."""
    cfg = model.config
    dense_t, expert_t = _types(dense_type, expert_type)
    sd = dict(model.state_dict())
    specs = [_weight("token_embd.weight", sd["model.embed_tokens.weight"], dense_t)]

    def add(name: str, t: Any) -> None:
        kind = "expert" if "_exps." in name else "f32" if t.ndim == 1 or "ffn_gate_inp" in name else "dense"
        t_type = expert_t if kind == "expert" else dense_t
        specs.append(_f32_spec(name, t) if kind == "f32" else _weight(name, t, t_type))

    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        at = hf + "self_attn."
        add(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"])
        for ours, theirs in ATTN:
            add(f"{p}{ours}.weight", sd[f"{at}{theirs}.weight"])
        add(p + "attn_q_norm.weight", sd[at + "q_norm.weight"])
        add(p + "attn_k_norm.weight", sd[at + "k_norm.weight"])
        add(p + "ffn_norm.weight", sd[hf + "post_attention_layernorm.weight"])
        add(p + "ffn_gate_inp.weight", sd[hf + "mlp.gate.weight"])
        add(p + "exp_probs_b.bias", sd[hf + "mlp.e_score_correction_bias"])
        ex = _experts(sd, i, cfg.num_local_experts, cfg.intermediate_size)
        for w in ("gate", "up", "down"):
            add(f"{p}ffn_{w}_exps.weight", torch.from_numpy(ex[w]))
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    md = minimax_m2_metadata(cfg, file_type=_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32))
    _write(path, ARCH, md, specs, cfg.vocab_size, tokenizer_md)


def _expected(c: Any) -> dict[str, Any]:
    return {"n_layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab_size": c.vocab_size,
            "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "rope_dim": rotary_dim(c), "n_experts": c.num_local_experts, "top_k": c.num_experts_per_tok,
            "expert_ffn": c.intermediate_size, "rms_eps": c.rms_norm_eps,
            "rope_theta": c.rope_parameters["rope_theta"]}  # fmt: skip


def _perturb(model: Any) -> None:
    """Distinct norms (a per-head norm in place of the whole-projection one shows), routers and correction
    biases far from near-ties."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.uniform_(-0.2, 0.2)


MINIMAX_M2 = TinyArch(ARCH, "MiniMaxM2ForCausalLM", tiny_minimax_m2_config, write_minimax_m2_from_hf, _perturb,
                      ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected)  # fmt: skip
