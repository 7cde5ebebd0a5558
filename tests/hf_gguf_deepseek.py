"""Tiny random DeepSeek-V2/V3 models (transformers) written as llama.cpp's converter writes deepseek2 files
(convert_hf_to_gguf.py DeepseekV2Model); tests/hf_gguf.py holds the shared helpers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

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


def tiny_deepseek_v3_config(**overrides: Any):
    """A small DeepseekV3Config with everything V3 routes by: sigmoid scores, a correction bias, 4 groups of
    which 2 are used, routed scaling != 1, one leading dense block, and YaRN (mscale = mscale_all_dim)."""
    from transformers import DeepseekV3Config

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        kv_lora_rank=128,
        q_lora_rank=128,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },  # fmt: skip
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def tiny_deepseek_v2_config(**overrides: Any):
    """A small DeepseekV2Config shaped like V2-Lite: no q LoRA (one attn_q), softmax routing, no groups, one
    leading dense block, YaRN with V2-Lite's mscale = mscale_all_dim = 0.707. With q_lora_rank and
    n_group/topk_group/topk_method="group_limited_greedy" it is shaped like V2 (236B) instead."""
    from transformers import DeepseekV2Config

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        routed_scaling_factor=1.0,
        kv_lora_rank=128,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        topk_method="greedy",
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },  # fmt: skip
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def tiny_deepseek_v2_grouped_config(**overrides: Any):
    kw: dict[str, Any] = dict(q_lora_rank=128, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                              routed_scaling_factor=16.0)  # fmt: skip
    return tiny_deepseek_v2_config(**(kw | overrides))


def deepseek2_metadata(cfg: Any, name: str = "tiny-deepseek2", file_type: int = 0, *, mla: bool = True) -> dict:
    """The general.* and deepseek2.* keys convert_hf_to_gguf.py (DeepseekV2Model and the TextModel base) writes.

    mla=False: the keys of converters before the k_b/v_b split (no *_mla keys, key/value length the
    decompressed head sizes, as many kv heads as query heads)."""
    a = "deepseek2."
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    sigmoid = type(cfg).__name__ == "DeepseekV3Config"  # config.json's scoring_func
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    md: dict[str, Any] = {
        "general.architecture": "deepseek2",
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        a + "block_count": cfg.num_hidden_layers,
        a + "context_length": cfg.max_position_embeddings,
        a + "embedding_length": cfg.hidden_size,
        a + "feed_forward_length": cfg.intermediate_size,
        a + "attention.head_count": cfg.num_attention_heads,
        a + "attention.head_count_kv": 1 if mla else cfg.num_attention_heads,
        a + "rope.freq_base": _rope_theta(cfg),
        a + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        a + "expert_count": cfg.n_routed_experts,
        a + "expert_used_count": cfg.num_experts_per_tok,
        a + "expert_gating_func": 2 if sigmoid else 1,
        a + "leading_dense_block_count": cfg.first_k_dense_replace,
        a + "vocab_size": cfg.vocab_size,
        a + "attention.kv_lora_rank": cfg.kv_lora_rank,
        a + "attention.key_length": cfg.kv_lora_rank + cfg.qk_rope_head_dim if mla else qk,
        a + "attention.value_length": cfg.kv_lora_rank if mla else cfg.v_head_dim,
        a + "expert_feed_forward_length": cfg.moe_intermediate_size,
        a + "expert_shared_count": cfg.n_shared_experts,
        a + "expert_weights_scale": float(cfg.routed_scaling_factor),
        a + "rope.dimension_count": cfg.qk_rope_head_dim,
    }
    if getattr(cfg, "n_group", None) is not None:
        md[a + "expert_group_count"] = cfg.n_group
    if getattr(cfg, "topk_group", None) is not None:
        md[a + "expert_group_used_count"] = cfg.topk_group
    if cfg.q_lora_rank is not None:
        md[a + "attention.q_lora_rank"] = cfg.q_lora_rank
    if mla:
        md[a + "attention.key_length_mla"] = qk
        md[a + "attention.value_length_mla"] = cfg.v_head_dim
    if cfg.norm_topk_prob:
        md[a + "expert_weights_norm"] = True
    if rope.get("rope_type") == "yarn":
        md[a + "rope.scaling.type"] = "yarn"
        md[a + "rope.scaling.factor"] = float(rope["factor"])
        md[a + "rope.scaling.original_context_length"] = int(rope["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                md[a + f"rope.scaling.yarn_{key}"] = float(rope[key])
        if rope.get("mscale_all_dim") is not None:
            md[a + "rope.scaling.yarn_log_multiplier"] = 0.1 * float(rope["mscale_all_dim"])
    return md


def write_deepseek2_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
    kv_b_split: bool = True,
) -> None:
    """Write `model` (transformers DeepseekV2ForCausalLM or DeepseekV3ForCausalLM) as a deepseek2 GGUF.

    kv_b_split: kv_b_proj as the converter writes it now, attn_k_b [H, kv_lora, nope] (k_b transposed
    per head) and attn_v_b [H, v, kv_lora]; False: one attn_kv_b [H * (nope + v), kv_lora] with the older
    keys (deepseek2_metadata mla=False). No rotary permutation: llama.cpp rotates deepseek2's interleaved
    pairs as they are. 1-D tensors, norms and the router stay F32; the correction bias is exp_probs_b.bias.
    """
    cfg = model.config
    dense_t, expert_t = _types(dense_type, expert_type)
    specs = deepseek2_specs(model, dense_t, expert_t, kv_b_split)
    md = deepseek2_metadata(cfg, file_type=_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32), mla=kv_b_split)
    _write(path, "deepseek2", md, specs, cfg.vocab_size, tokenizer_md)


LayerExtra = Callable[[dict, str, str, T], list]  # (state dict, HF layer prefix, GGUF prefix, dense type) -> specs


def deepseek2_specs(model: Any, dense_t: T, expert_t: T, kv_b_split: bool = True,
                    extra: LayerExtra | None = None) -> list:  # fmt: skip
    """The tensors of a deepseek2-shaped file (see write_deepseek2_from_hf); `extra` adds a block's own after
    its attention's (the sparse attention's indexer)."""
    cfg = model.config
    sd = dict(model.state_dict())
    weight, f32 = _weight, _f32_spec
    nh, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    specs = [weight("token_embd.weight", sd["model.embed_tokens.weight"], dense_t)]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        at = hf + "self_attn."
        specs.append(f32(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"]))
        if cfg.q_lora_rank is None:
            specs.append(weight(p + "attn_q.weight", sd[at + "q_proj.weight"], dense_t))
        else:
            specs += [weight(p + "attn_q_a.weight", sd[at + "q_a_proj.weight"], dense_t),
                      f32(p + "attn_q_a_norm.weight", sd[at + "q_a_layernorm.weight"]),
                      weight(p + "attn_q_b.weight", sd[at + "q_b_proj.weight"], dense_t)]  # fmt: skip
        specs += [weight(p + "attn_kv_a_mqa.weight", sd[at + "kv_a_proj_with_mqa.weight"], dense_t),
                  f32(p + "attn_kv_a_norm.weight", sd[at + "kv_a_layernorm.weight"])]  # fmt: skip
        kv_b = sd[at + "kv_b_proj.weight"]
        if kv_b_split:
            k_b, v_b = kv_b.view(nh, nope + v, -1).split([nope, v], dim=1)
            specs += [weight(p + "attn_k_b.weight", k_b.transpose(1, 2), dense_t),
                      weight(p + "attn_v_b.weight", v_b, dense_t)]  # fmt: skip
        else:
            specs.append(weight(p + "attn_kv_b.weight", kv_b, dense_t))
        specs.append(weight(p + "attn_output.weight", sd[at + "o_proj.weight"], dense_t))
        if extra is not None:
            specs += extra(sd, hf, p, dense_t)
        specs.append(f32(p + "ffn_norm.weight", sd[hf + "post_attention_layernorm.weight"]))
        if i < cfg.first_k_dense_replace:
            for w in ("gate", "up", "down"):
                specs.append(weight(f"{p}ffn_{w}.weight", sd[f"{hf}mlp.{w}_proj.weight"], dense_t))
            continue
        specs.append(f32(p + "ffn_gate_inp.weight", sd[hf + "mlp.gate.weight"]))
        if (bias := sd.get(hf + "mlp.gate.e_score_correction_bias")) is not None:
            specs.append(f32(p + "exp_probs_b.bias", bias))
        ex = _experts(sd, i, cfg.n_routed_experts, cfg.moe_intermediate_size)
        for w in ("gate", "up", "down"):
            specs.append(weight(f"{p}ffn_{w}_exps.weight", ex[w], expert_t))
        for w in ("gate", "up", "down"):
            specs.append(weight(f"{p}ffn_{w}_shexp.weight", sd[f"{hf}mlp.shared_experts.{w}_proj.weight"], dense_t))
    specs.append(f32("output_norm.weight", sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        specs.append(weight("output.weight", sd["lm_head.weight"], dense_t))
    return specs


def _expected_deepseek2(c: Any) -> dict[str, Any]:
    return {"n_layers": c.num_hidden_layers - c.first_k_dense_replace, "n_blocks": c.num_hidden_layers,
            "first_moe_block": c.first_k_dense_replace, "hidden": c.hidden_size, "vocab_size": c.vocab_size,
            "n_heads": c.num_attention_heads, "q_lora_rank": c.q_lora_rank or 0, "kv_lora_rank": c.kv_lora_rank,
            "qk_nope": c.qk_nope_head_dim, "qk_rope": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
            "n_experts": c.n_routed_experts, "top_k": c.num_experts_per_tok, "expert_ffn": c.moe_intermediate_size,
            "shared_ffn": c.n_shared_experts * c.moe_intermediate_size, "dense_ffn": c.intermediate_size,
            "rms_eps": c.rms_norm_eps, "rope_theta": c.rope_parameters["rope_theta"]}  # fmt: skip


def _perturb_deepseek2(model: Any) -> None:
    """Distinct norms; routers and correction biases large enough that the choice is never a near-tie."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.uniform_(-0.2, 0.2)


DEEPSEEK_V3 = TinyArch("deepseek2", "DeepseekV3ForCausalLM", tiny_deepseek_v3_config, write_deepseek2_from_hf,
                       _perturb_deepseek2, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_deepseek2,
                       "deepseek-v3")  # fmt: skip


DEEPSEEK_V2_LITE = TinyArch("deepseek2", "DeepseekV2ForCausalLM", tiny_deepseek_v2_config,
                            functools.partial(write_deepseek2_from_hf, kv_b_split=False), _perturb_deepseek2,
                            ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_deepseek2, "deepseek-v2-lite")  # fmt: skip


DEEPSEEK_V2 = TinyArch("deepseek2", "DeepseekV2ForCausalLM", tiny_deepseek_v2_grouped_config, write_deepseek2_from_hf,
                       _perturb_deepseek2, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_deepseek2,
                       "deepseek-v2")  # fmt: skip
