"""Tiny random GLM-4.5 models (transformers) written as llama.cpp's converter writes glm4moe files (Glm4MoeModel),
with the trailing nextn (MTP) block; tests/hf_gguf.py holds the shared helpers.
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


def tiny_glm4moe_config(**overrides: Any):
    """A small Glm4MoeConfig shaped like GLM-4.5: q/k/v biases, q/k norms, half the head rotated, sigmoid
    routing with a correction bias within 1 of 2 groups, routed scaling != 1, one leading dense block, a
    shared expert and one MTP block (which transformers does not build; the writer adds it)."""
    from transformers import Glm4MoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        num_nextn_predict_layers=1,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Glm4MoeConfig(**kw)


def tiny_glm45_air_config(**overrides: Any):
    """GLM-4.5-Air's choices: no q/k norm, no expert groups, routed scaling 1."""
    kw: dict[str, Any] = dict(use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    return tiny_glm4moe_config(**(kw | overrides))


def glm4moe_metadata(cfg: Any, name: str = "tiny-glm4moe", file_type: int = 0, *, mtp: bool = True) -> dict:
    """The general.* and glm4moe.* keys convert_hf_to_gguf.py (Glm4MoeModel and the TextModel base) writes;
    block_count includes the MTP blocks unless they are left out (the converter's --no-mtp)."""
    a = "glm4moe."
    nextn = cfg.num_nextn_predict_layers if mtp else 0
    rope = cfg.rope_parameters
    md: dict[str, Any] = {
        "general.architecture": "glm4moe",
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        a + "block_count": cfg.num_hidden_layers + nextn,
        a + "context_length": cfg.max_position_embeddings,
        a + "embedding_length": cfg.hidden_size,
        a + "feed_forward_length": cfg.intermediate_size,
        a + "attention.head_count": cfg.num_attention_heads,
        a + "attention.head_count_kv": cfg.num_key_value_heads,
        a + "rope.freq_base": _rope_theta(cfg),
        a + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        a + "expert_used_count": cfg.num_experts_per_tok,
        a + "expert_group_count": cfg.n_group,
        a + "expert_group_used_count": cfg.topk_group,
        a + "attention.key_length": cfg.head_dim,
        a + "attention.value_length": cfg.head_dim,
        a + "rope.dimension_count": int(cfg.head_dim * rope.get("partial_rotary_factor", 0.5)),
        a + "expert_count": cfg.n_routed_experts,
        a + "expert_feed_forward_length": cfg.moe_intermediate_size,
        a + "expert_shared_count": cfg.n_shared_experts,
        a + "leading_dense_block_count": cfg.first_k_dense_replace,
        a + "expert_gating_func": 2,
        a + "expert_weights_scale": float(cfg.routed_scaling_factor),
        a + "expert_weights_norm": bool(cfg.norm_topk_prob),
    }
    if nextn:
        md[a + "nextn_predict_layers"] = nextn
    return md


def _glm4moe_mtp_block(cfg: Any, seed: int = 7) -> dict[str, torch.Tensor]:
    """What a GLM-4.5 checkpoint holds for its MTP block (model.layers.N.*), by GGUF suffix: a whole MoE
    block plus eh_proj and its norms. Random: only the names, shapes and types matter to the loader."""
    g = torch.Generator().manual_seed(seed)
    H, D, E, F = cfg.hidden_size, cfg.head_dim, cfg.n_routed_experts, cfg.moe_intermediate_size
    nq, nkv, S = cfg.num_attention_heads * D, cfg.num_key_value_heads * D, F * cfg.n_shared_experts
    shapes = {"attn_norm.weight": (H,), "attn_q.weight": (nq, H), "attn_q.bias": (nq,), "attn_k.weight": (nkv, H),
              "attn_k.bias": (nkv,), "attn_v.weight": (nkv, H), "attn_v.bias": (nkv,), "attn_output.weight": (H, nq),
              "post_attention_norm.weight": (H,), "ffn_gate_inp.weight": (E, H), "exp_probs_b.bias": (E,),
              "ffn_gate_exps.weight": (E, F, H), "ffn_up_exps.weight": (E, F, H), "ffn_down_exps.weight": (E, H, F),
              "ffn_gate_shexp.weight": (S, H), "ffn_up_shexp.weight": (S, H), "ffn_down_shexp.weight": (H, S),
              "nextn.eh_proj.weight": (H, 2 * H), "nextn.enorm.weight": (H,), "nextn.hnorm.weight": (H,),
              "nextn.shared_head_norm.weight": (H,)}  # fmt: skip
    if cfg.use_qk_norm:
        shapes |= {"attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,)}
    return {k: torch.randn(shape, generator=g) * 0.05 for k, shape in shapes.items()}


def write_glm4moe_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
    mtp: bool = True,
) -> None:
    """Write `model` (transformers Glm4MoeForCausalLM) as a glm4moe GGUF, with its MTP block(s) appended as
    blk.N.* (the converter's default; mtp=False is its --no-mtp). No q/k permutation: glm4moe rotates NeoX
    halves as transformers does. The post-attention norm is post_attention_norm; 1-D tensors, norms and the
    router stay F32; the correction bias is exp_probs_b.bias."""
    cfg = model.config
    dense_t, expert_t = _types(dense_type, expert_type)
    sd = dict(model.state_dict())
    specs = [_weight("token_embd.weight", sd["model.embed_tokens.weight"], dense_t)]

    def add(name: str, t: torch.Tensor) -> None:
        kind = "expert" if "_exps." in name else "f32" if t.ndim == 1 or "ffn_gate_inp" in name else "dense"
        if kind == "f32":
            specs.append(_f32_spec(name, t))
        else:
            specs.append(_weight(name, t, expert_t if kind == "expert" else dense_t))

    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        at = hf + "self_attn."
        add(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            add(f"{p}{ours}.weight", sd[f"{at}{theirs}.weight"])
            if (bias := sd.get(f"{at}{theirs}.bias")) is not None:
                add(f"{p}{ours}.bias", bias)
        add(p + "attn_output.weight", sd[at + "o_proj.weight"])
        if cfg.use_qk_norm:
            add(p + "attn_q_norm.weight", sd[at + "q_norm.weight"])
            add(p + "attn_k_norm.weight", sd[at + "k_norm.weight"])
        add(p + "post_attention_norm.weight", sd[hf + "post_attention_layernorm.weight"])
        if i < cfg.first_k_dense_replace:
            for w in ("gate", "up", "down"):
                add(f"{p}ffn_{w}.weight", sd[f"{hf}mlp.{w}_proj.weight"])
            continue
        add(p + "ffn_gate_inp.weight", sd[hf + "mlp.gate.weight"])
        add(p + "exp_probs_b.bias", sd[hf + "mlp.gate.e_score_correction_bias"])
        ex = _experts(sd, i, cfg.n_routed_experts, cfg.moe_intermediate_size)
        for w in ("gate", "up", "down"):
            add(f"{p}ffn_{w}_exps.weight", torch.from_numpy(ex[w]))
        for w in ("gate", "up", "down"):
            add(f"{p}ffn_{w}_shexp.weight", sd[f"{hf}mlp.shared_experts.{w}_proj.weight"])
    for j in range(cfg.num_nextn_predict_layers if mtp else 0):
        for suffix, t in _glm4moe_mtp_block(cfg, seed=7 + j).items():
            add(f"blk.{cfg.num_hidden_layers + j}.{suffix}", t)
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    md = glm4moe_metadata(cfg, file_type=_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32), mtp=mtp)
    _write(path, "glm4moe", md, specs, cfg.vocab_size, tokenizer_md)


def _expected_glm4moe(c: Any) -> dict[str, Any]:
    return {"n_layers": c.num_hidden_layers - c.first_k_dense_replace, "n_blocks": c.num_hidden_layers,
            "first_moe_block": c.first_k_dense_replace, "hidden": c.hidden_size, "vocab_size": c.vocab_size,
            "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "rope_dim": c.head_dim // 2, "n_experts": c.n_routed_experts, "top_k": c.num_experts_per_tok,
            "expert_ffn": c.moe_intermediate_size, "shared_ffn": c.n_shared_experts * c.moe_intermediate_size,
            "dense_ffn": c.intermediate_size, "rms_eps": c.rms_norm_eps,
            "rope_theta": c.rope_parameters["rope_theta"]}  # fmt: skip


def _perturb_glm4moe(model: Any) -> None:
    """Distinct norms, biases that matter, routers and correction biases far from near-ties."""
    for name, p in model.named_parameters():
        if name.endswith("proj.bias"):
            p.normal_(0.0, 0.5)
        elif p.ndim == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.uniform_(-0.2, 0.2)


GLM4MOE = TinyArch("glm4moe", "Glm4MoeForCausalLM", tiny_glm4moe_config, write_glm4moe_from_hf, _perturb_glm4moe,
                   ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_glm4moe, "glm-4.5")  # fmt: skip


GLM45_AIR = TinyArch("glm4moe", "Glm4MoeForCausalLM", tiny_glm45_air_config, write_glm4moe_from_hf,
                     _perturb_glm4moe, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_glm4moe,
                     "glm-4.5-air")  # fmt: skip
