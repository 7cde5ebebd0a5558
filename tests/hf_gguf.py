"""Test helpers: tiny random transformers models written as the GGUF llama.cpp's converter would make,
one writer per architecture, and a rewriter that changes a file's metadata or tensors (bad-file tests).

qwen3moe mirrors convert_hf_to_gguf.py's Qwen2MoeModel / Qwen3MoeModel: the same tensor names, no q/k
permutation (qwen3moe uses NeoX rope, only llama-arch models are permuted), per-expert weights stacked
into [E, rows, cols] tensors, 1-D tensors and the router in F32, the same metadata keys.

qwen35moe mirrors conversion/qwen.py (Qwen3NextModel, _LinearAttentionVReorderBase, _Qwen35MRopeMixin,
Qwen3_5MoeTextModel; base.py for the common keys and the F32 rules):
  - every `*norm.weight` except the DeltaNet's output norm gets +1 (HF computes x_hat * (1 + w));
  - A_log -> ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias; conv1d [C, 1, K] -> [C, K];
  - with fewer key than value heads, value heads go from grouped (by key head) to tiled order in
    in_proj_qkv's V rows, in_proj_z, in_proj_a/b, A_log, dt_bias, the conv's V channels and out_proj's
    columns, so value head h reads key head h % n_k;
  - 1-D tensors, norms, the router, the shared-expert gate and the conv kernel stay F32.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from moestream.formats.gguf_file import GGUFFile
from moestream.formats.gguf_write import TensorSpec, array_tensor, write_gguf
from moestream.formats.quants import quantize
from moestream.formats.tokenizer import build_tiny_bpe_metadata

_FILE_TYPE = {
    T.F32: LlamaFileType.ALL_F32,
    T.F16: LlamaFileType.MOSTLY_F16,
    T.BF16: LlamaFileType.MOSTLY_BF16,
    T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    T.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    T.Q6_K: LlamaFileType.MOSTLY_Q6_K,
}


def _weight(name: str, w: torch.Tensor | np.ndarray, t: T) -> TensorSpec:
    a = _f32(w) if isinstance(w, torch.Tensor) else w
    return array_tensor(name, t, a.shape, quantize(a, int(t)))


def _f32_spec(name: str, w: torch.Tensor) -> TensorSpec:
    a = _f32(w)
    return array_tensor(name, T.F32, a.shape, a)


def _types(dense_type: int | str, expert_type: int | str) -> tuple[T, T]:
    return tuple(T[t] if isinstance(t, str) else T(t) for t in (dense_type, expert_type))  # type: ignore[return-value]


def _write(path: str | os.PathLike[str], arch: str, md: dict[str, Any], specs: list[TensorSpec], vocab: int,
           tokenizer_md: dict[str, Any] | None) -> None:  # fmt: skip
    """tokenizer_md: GGUF tokenizer keys; None writes the tiny BPE vocab (which must have `vocab` tokens), {}
    writes none."""
    if tokenizer_md is None:
        tokenizer_md = tiny_tokenizer_metadata()
        if len(tokenizer_md["tokenizer.ggml.tokens"]) != vocab:
            raise ValueError(
                f"vocab_size {vocab} differs from the tiny BPE vocab ({tiny_vocab_size()}); "
                "pass tokenizer_md={} to write no tokenizer"
            )
    write_gguf(path, arch, md | tokenizer_md, specs, progress=False)


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_metadata() -> dict[str, Any]:
    return build_tiny_bpe_metadata()


def tiny_vocab_size() -> int:
    return len(tiny_tokenizer_metadata()["tokenizer.ggml.tokens"])


# ---- qwen3moe -------------------------------------------------------------------------------------


def tiny_qwen3moe_config(**overrides: Any):
    """A small Qwen3MoeConfig whose sizes are multiples of 256, so every GGUF type (Q4_K too) fits."""
    from transformers import Qwen3MoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # Qwen3-30B-A3B's setting; llama.cpp's qwen3moe always renormalizes
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(cfg, "rope_theta", 10000.0))


def _experts(sd: dict[str, torch.Tensor], layer: int, n_experts: int, ffn: int) -> dict[str, np.ndarray]:
    """gate/up [E, F, H] and down [E, H, F] from either expert layout transformers has used."""
    p = f"model.layers.{layer}.mlp.experts."
    if p + "gate_up_proj" in sd:  # transformers 5: fused [E, 2F, H], gate first (forward does chunk(2))
        gate_up = sd[p + "gate_up_proj"]
        if gate_up.shape[1] != 2 * ffn:
            raise ValueError(f"layer {layer}: gate_up_proj {tuple(gate_up.shape)} is not [E, 2*{ffn}, H]")
        gate, up, down = gate_up[:, :ffn], gate_up[:, ffn:], sd[p + "down_proj"]
    else:  # transformers 4: one nn.Linear per expert, stacked as the converter does
        gate, up, down = (
            torch.stack([sd[f"{p}{e}.{w}.weight"] for e in range(n_experts)])
            for w in ("gate_proj", "up_proj", "down_proj")
        )
    return {"gate": _f32(gate), "up": _f32(up), "down": _f32(down)}


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def qwen3moe_metadata(cfg: Any, name: str = "tiny-qwen3moe", file_type: int = 0) -> dict[str, Any]:
    """The general.* and qwen3moe.* keys convert_hf_to_gguf.py writes for a Qwen3MoeConfig."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "general.architecture": "qwen3moe",
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        "qwen3moe.block_count": cfg.num_hidden_layers,
        "qwen3moe.context_length": cfg.max_position_embeddings,
        "qwen3moe.embedding_length": cfg.hidden_size,
        "qwen3moe.feed_forward_length": cfg.intermediate_size,
        "qwen3moe.attention.head_count": cfg.num_attention_heads,
        "qwen3moe.attention.head_count_kv": cfg.num_key_value_heads,
        "qwen3moe.rope.freq_base": _rope_theta(cfg),
        "qwen3moe.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "qwen3moe.expert_used_count": cfg.num_experts_per_tok,
        "qwen3moe.attention.key_length": head_dim,
        "qwen3moe.attention.value_length": head_dim,
        "qwen3moe.expert_count": cfg.num_experts,
        "qwen3moe.expert_feed_forward_length": cfg.moe_intermediate_size,
    }


def write_qwen3moe_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
) -> None:
    """Write `model` (transformers Qwen3MoeForCausalLM) as a qwen3moe GGUF.

    dense_type: embeddings, attention and output weights; expert_type: the three exps tensors.
    Norms, biases and the router stay F32 as in the converter. tokenizer_md: see _write.
    """
    cfg = model.config
    dense_t, expert_t = _types(dense_type, expert_type)
    if cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers:
        raise ValueError(
            "qwen3moe GGUFs need every layer to be a MoE layer (decoder_sparse_step=1, no mlp_only_layers)"
        )
    sd = dict(model.state_dict())
    specs = [_weight("token_embd.weight", sd["model.embed_tokens.weight"], dense_t)]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        specs.append(_f32_spec(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"]))
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):  # fmt: skip
            specs.append(_weight(f"{p}{ours}.weight", sd[f"{hf}self_attn.{theirs}.weight"], dense_t))
            if (bias := sd.get(f"{hf}self_attn.{theirs}.bias")) is not None:
                specs.append(_f32_spec(f"{p}{ours}.bias", bias))
        specs.append(_f32_spec(p + "attn_q_norm.weight", sd[hf + "self_attn.q_norm.weight"]))
        specs.append(_f32_spec(p + "attn_k_norm.weight", sd[hf + "self_attn.k_norm.weight"]))
        specs.append(_f32_spec(p + "ffn_norm.weight", sd[hf + "post_attention_layernorm.weight"]))
        specs.append(_f32_spec(p + "ffn_gate_inp.weight", sd[hf + "mlp.gate.weight"]))  # the converter forces F32
        ex = _experts(sd, i, cfg.num_experts, cfg.moe_intermediate_size)
        for w in ("gate", "up", "down"):
            specs.append(_weight(f"{p}ffn_{w}_exps.weight", ex[w], expert_t))
    specs.append(_f32_spec("output_norm.weight", sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        specs.append(_weight("output.weight", sd["lm_head.weight"], dense_t))
    md = qwen3moe_metadata(cfg, file_type=_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32))
    _write(path, "qwen3moe", md, specs, cfg.vocab_size, tokenizer_md)


# ---- qwen35moe ------------------------------------------------------------------------------------

DEFAULT_MROPE_SECTION = [11, 11, 10, 0]  # what the converter writes when the config has none


def tiny_qwen35moe_config(**overrides: Any):
    """A small Qwen3_5MoeTextConfig with both layer kinds and fewer key than value heads (the V reorder).

    Sizes are multiples of 256 where a matrix's input dimension needs it, so Q4_K fits every weight.
    """
    from transformers import Qwen3_5MoeTextConfig

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        full_attention_interval=2,  # linear, full, linear, full
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen3_5MoeTextConfig(**kw)


def _reorder_v_heads(t: torch.Tensor, dim: int, n_k: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Grouped [k0: v0..v(r-1), k1: ...] -> tiled [v0: k0, k1, ..., v1: k0, k1, ...] along `dim`."""
    shape = list(t.shape)
    dim = dim % len(shape)
    t = t.reshape(*shape[:dim], n_k, per_k, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _linear_attn_tensors(sd: dict[str, torch.Tensor], hf: str, cfg: Any) -> dict[str, torch.Tensor]:
    """HF linear_attn tensors of one layer, in the converter's head order."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    t = {n: sd[hf + "linear_attn." + n] for n in (
        "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias",
        "conv1d.weight", "out_proj.weight", "norm.weight",
    )}  # fmt: skip
    t["conv1d.weight"] = t["conv1d.weight"].squeeze(1)
    if nk != nv:
        r, qk = nv // nk, 2 * nk * dk

        def tiled(x: torch.Tensor, dim: int, hd: int) -> torch.Tensor:
            return _reorder_v_heads(x, dim, nk, r, hd)

        for name in ("in_proj_qkv.weight", "conv1d.weight"):  # only the V rows / channels move
            x = t[name]
            t[name] = torch.cat([x[:qk], tiled(x[qk:], 0, dv)])
        t["in_proj_z.weight"] = tiled(t["in_proj_z.weight"], 0, dv)
        for name in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
            t[name] = tiled(t[name], 0, 1)
        t["out_proj.weight"] = tiled(t["out_proj.weight"], 1, dv)
    t["A_log"] = -torch.exp(t["A_log"].float())
    return t


def qwen35moe_metadata(
    cfg: Any, name: str = "tiny-qwen35moe", file_type: int = 0, *, recurrent_layers: bool = True
) -> dict[str, Any]:
    """The general.* and qwen35moe.* keys convert_hf_to_gguf.py writes for a Qwen3_5MoeTextConfig."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    head_dim = cfg.head_dim
    sections = list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)
    sections += [0] * (4 - len(sections))
    md = {
        "general.architecture": "qwen35moe",
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        "qwen35moe.block_count": cfg.num_hidden_layers,
        "qwen35moe.context_length": cfg.max_position_embeddings,
        "qwen35moe.embedding_length": cfg.hidden_size,
        "qwen35moe.attention.head_count": cfg.num_attention_heads,
        "qwen35moe.attention.head_count_kv": cfg.num_key_value_heads,
        "qwen35moe.rope.freq_base": _rope_theta(cfg),
        "qwen35moe.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "qwen35moe.expert_count": cfg.num_experts,
        "qwen35moe.expert_used_count": cfg.num_experts_per_tok,
        "qwen35moe.attention.key_length": head_dim,
        "qwen35moe.attention.value_length": head_dim,
        "qwen35moe.expert_feed_forward_length": cfg.moe_intermediate_size,
        "qwen35moe.expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
        "qwen35moe.ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        "qwen35moe.ssm.state_size": cfg.linear_key_head_dim,
        "qwen35moe.ssm.group_count": cfg.linear_num_key_heads,
        "qwen35moe.ssm.time_step_rank": cfg.linear_num_value_heads,
        "qwen35moe.ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
        # the converter reads the interval from the config file, where transformers does not keep it
        "qwen35moe.full_attention_interval": int(getattr(cfg, "full_attention_interval", 4)),
        "qwen35moe.rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 0.25)),
        "qwen35moe.rope.dimension_sections": sections[:4],
    }
    if recurrent_layers:
        md["qwen35moe.attention.recurrent_layers"] = [t == "linear_attention" for t in cfg.layer_types]
    return md


def write_qwen35moe_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
    recurrent_layers: bool = True,
    full_attention_interval: int | None = None,
    nextn_block: bool = False,
) -> None:
    """Write `model` (transformers Qwen3_5MoeForCausalLM) as a qwen35moe GGUF.

    dense_type: embeddings, projections, shared expert and output; expert_type: the three exps tensors.
    recurrent_layers=False with full_attention_interval: the layer kinds only as an interval (older
    converters). nextn_block: append an MTP block (blk.N, nextn_predict_layers = 1) as the converter does
    for checkpoints that have one; the model must not run it.
    """
    cfg = model.config
    dense_t, expert_t = _types(dense_type, expert_type)
    sd = dict(model.state_dict())
    weight, f32 = _weight, _f32_spec

    def norm(name: str, w: torch.Tensor) -> TensorSpec:
        return f32(name, w.float() + 1)

    def block(i: int, hf: str, p: str, linear_attention: bool) -> list[TensorSpec]:
        out = [norm(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"]),
               norm(p + "post_attention_norm.weight", sd[hf + "post_attention_layernorm.weight"])]  # fmt: skip
        if linear_attention:
            la = _linear_attn_tensors(sd, hf, cfg)
            out += [
                weight(p + "attn_qkv.weight", la["in_proj_qkv.weight"], dense_t),
                weight(p + "attn_gate.weight", la["in_proj_z.weight"], dense_t),
                weight(p + "ssm_beta.weight", la["in_proj_b.weight"], dense_t),
                weight(p + "ssm_alpha.weight", la["in_proj_a.weight"], dense_t),
                f32(p + "ssm_conv1d.weight", la["conv1d.weight"]),
                f32(p + "ssm_dt.bias", la["dt_bias"]),
                f32(p + "ssm_a", la["A_log"]),
                f32(p + "ssm_norm.weight", la["norm.weight"]),  # no +1: a plain-weight gated RMSNorm
                weight(p + "ssm_out.weight", la["out_proj.weight"], dense_t),
            ]
        else:
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                 ("attn_output", "o_proj")):  # fmt: skip
                out.append(weight(f"{p}{ours}.weight", sd[f"{hf}self_attn.{theirs}.weight"], dense_t))
            out.append(norm(p + "attn_q_norm.weight", sd[hf + "self_attn.q_norm.weight"]))
            out.append(norm(p + "attn_k_norm.weight", sd[hf + "self_attn.k_norm.weight"]))
        out.append(f32(p + "ffn_gate_inp.weight", sd[hf + "mlp.gate.weight"]))
        out.append(f32(p + "ffn_gate_inp_shexp.weight", sd[hf + "mlp.shared_expert_gate.weight"]))
        for w in ("gate", "up", "down"):
            out.append(weight(f"{p}ffn_{w}_shexp.weight", sd[f"{hf}mlp.shared_expert.{w}_proj.weight"], dense_t))
        ex = _experts(sd, i, cfg.num_experts, cfg.moe_intermediate_size)
        for w in ("gate", "up", "down"):
            out.append(weight(f"{p}ffn_{w}_exps.weight", ex[w], expert_t))
        return out

    n = cfg.num_hidden_layers
    specs = [weight("token_embd.weight", sd["model.embed_tokens.weight"], dense_t)]
    for i in range(n):
        specs += block(i, f"model.layers.{i}.", f"blk.{i}.", cfg.layer_types[i] == "linear_attention")
    md = qwen35moe_metadata(cfg, file_type=_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32),
                            recurrent_layers=recurrent_layers)  # fmt: skip
    if full_attention_interval is not None:
        md["qwen35moe.full_attention_interval"] = full_attention_interval
    if nextn_block:  # an MTP block shaped like a full-attention layer (a copy of the last one) plus nextn.*
        last_full = max(i for i in range(n) if cfg.layer_types[i] == "full_attention")
        specs += block(last_full, f"model.layers.{last_full}.", f"blk.{n}.", False)
        H = cfg.hidden_size
        rng = np.random.default_rng(0)
        specs += [
            weight(f"blk.{n}.nextn.eh_proj.weight", rng.standard_normal((H, 2 * H), np.float32) * 0.02, dense_t),
            f32(f"blk.{n}.nextn.enorm.weight", torch.ones(H)),
            f32(f"blk.{n}.nextn.hnorm.weight", torch.ones(H)),
        ]
        md["qwen35moe.block_count"] = n + 1
        md["qwen35moe.nextn_predict_layers"] = 1
        if recurrent_layers:
            md["qwen35moe.attention.recurrent_layers"] = md["qwen35moe.attention.recurrent_layers"] + [False]
    specs.append(norm("output_norm.weight", sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        specs.append(weight("output.weight", sd["lm_head.weight"], dense_t))

    _write(path, "qwen35moe", md, specs, cfg.vocab_size, tokenizer_md)


# ---- deepseek2 ------------------------------------------------------------------------------------


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
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},  # fmt: skip
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
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707},  # fmt: skip
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
    md = deepseek2_metadata(cfg, file_type=_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32), mla=kv_b_split)
    _write(path, "deepseek2", md, specs, cfg.vocab_size, tokenizer_md)


# ---- glm4moe --------------------------------------------------------------------------------------


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


# ---- gpt-oss --------------------------------------------------------------------------------------


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


# e2m1 values of the 16 codes (sign bit 3), as the MXFP4 checkpoints and transformers' dequantizer have them
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


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


# ---- bad files -------------------------------------------------------------------------------------


def rewrite_gguf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    metadata: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> None:
    """Copy a GGUF with metadata keys changed (a value of None drops the key) and tensors replaced (written
    as F32 arrays of any shape): the damaged files the loader must refuse in one line."""
    f = GGUFFile(src)
    try:
        md = {k: v for k, v in (dict(f.metadata) | (metadata or {})).items() if v is not None}
        md = {k: v for k, v in md.items() if not k.startswith("GGUF.") and k != "general.alignment"}
        specs = []
        for name, info in f.tensors.items():
            if tensors and name in tensors:
                a = np.ascontiguousarray(tensors[name], dtype=np.float32)
                specs.append(array_tensor(name, T.F32, a.shape, a))
            else:
                specs.append(array_tensor(name, info.ggml_type, info.shape, f.read(name)))
        write_gguf(dst, f.arch, md, specs, progress=False)
    finally:
        f.close()


# ---- what the model tests share ---------------------------------------------------------------------


def one_torch_thread() -> Iterator[None]:
    """Tiny matrices: a second thread only adds barriers, and on a busy machine each can cost a time slice.
    A module makes it its fixture with pytest.fixture(autouse=True, scope="module")(one_torch_thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_tokens(n: int, vocab: int, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---- what a parametrized test needs to know of each architecture ------------------------------------


@dataclass(frozen=True)
class TinyArch:
    name: str  # the GGUF architecture
    hf_class: str  # transformers' causal-LM class
    config: Callable[..., Any]  # a tiny transformers config (overrides as keywords)
    write: Callable[..., None]  # (model, path, *, dense_type, expert_type, tokenizer_md) -> a GGUF
    perturb: Callable[[Any], None]  # make the norms distinct so a mix-up or a wrong offset shows
    stream_types: tuple[tuple[T, T], ...]  # (dense, expert) types the streaming test runs
    # what moestream's config must read from the file, as (attribute, value) pairs of the HF config
    expected: Callable[[Any], dict[str, Any]] = field(default=lambda c: _expected_gqa(c))
    label: str = ""  # the test id where one GGUF architecture has several shapes

    @property
    def id(self) -> str:
        return self.label or self.name

    def hf_model(self, seed: int = 0, **overrides: Any) -> Any:
        import transformers

        torch.manual_seed(seed)
        model = getattr(transformers, self.hf_class)(self.config(**overrides)).eval()
        with torch.no_grad():
            self.perturb(model)
        return model


def n_experts(cfg: Any) -> int:
    """The routed experts of a transformers config, whatever it calls them."""
    if hasattr(cfg, "num_local_experts"):
        return cfg.num_local_experts
    return cfg.num_experts if hasattr(cfg, "num_experts") else cfg.n_routed_experts


def _expected_gqa(c: Any) -> dict[str, Any]:
    return {"n_layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab_size": c.vocab_size,
            "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "n_experts": c.num_experts, "top_k": c.num_experts_per_tok, "expert_ffn": c.moe_intermediate_size,
            "rms_eps": c.rms_norm_eps, "rope_theta": c.rope_parameters["rope_theta"]}  # fmt: skip


def _expected_deepseek2(c: Any) -> dict[str, Any]:
    return {"n_layers": c.num_hidden_layers - c.first_k_dense_replace, "n_blocks": c.num_hidden_layers,
            "first_moe_block": c.first_k_dense_replace, "hidden": c.hidden_size, "vocab_size": c.vocab_size,
            "n_heads": c.num_attention_heads, "q_lora_rank": c.q_lora_rank or 0, "kv_lora_rank": c.kv_lora_rank,
            "qk_nope": c.qk_nope_head_dim, "qk_rope": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
            "n_experts": c.n_routed_experts, "top_k": c.num_experts_per_tok, "expert_ffn": c.moe_intermediate_size,
            "shared_ffn": c.n_shared_experts * c.moe_intermediate_size, "dense_ffn": c.intermediate_size,
            "rms_eps": c.rms_norm_eps, "rope_theta": c.rope_parameters["rope_theta"]}  # fmt: skip


def _perturb_qwen3moe(model: Any) -> None:
    for p in model.parameters():
        if p.ndim == 1:
            p.uniform_(0.5, 1.5)


def _perturb_qwen35moe(model: Any) -> None:
    # norms start at 0 (HF adds 1) and 1: make them distinct so a wrong offset shows
    for name, p in model.named_parameters():
        if p.ndim == 1 and "norm" in name:
            p.uniform_(0.5, 1.5) if "linear_attn.norm" in name else p.uniform_(-0.5, 0.5)


QWEN3MOE = TinyArch("qwen3moe", "Qwen3MoeForCausalLM", tiny_qwen3moe_config, write_qwen3moe_from_hf,
                    _perturb_qwen3moe, ((T.F32, T.F32), (T.Q4_K, T.Q4_K)))  # fmt: skip
# Q4_0 experts take the same int4 kernels as Q4_K ones (and quantize 100x faster); Q8_0 dense: bf16 matmuls
QWEN35MOE = TinyArch("qwen35moe", "Qwen3_5MoeForCausalLM", tiny_qwen35moe_config, write_qwen35moe_from_hf,
                     _perturb_qwen35moe, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)))  # fmt: skip


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
# V2-Lite's shape, written as converters before the k_b/v_b split did (one attn_kv_b)
DEEPSEEK_V2_LITE = TinyArch("deepseek2", "DeepseekV2ForCausalLM", tiny_deepseek_v2_config,
                            functools.partial(write_deepseek2_from_hf, kv_b_split=False), _perturb_deepseek2,
                            ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_deepseek2, "deepseek-v2-lite")  # fmt: skip
DEEPSEEK_V2 = TinyArch("deepseek2", "DeepseekV2ForCausalLM", tiny_deepseek_v2_grouped_config, write_deepseek2_from_hf,
                       _perturb_deepseek2, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_deepseek2,
                       "deepseek-v2")  # fmt: skip


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
GLM4MOE = TinyArch("glm4moe", "Glm4MoeForCausalLM", tiny_glm4moe_config, write_glm4moe_from_hf, _perturb_glm4moe,
                   ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_glm4moe, "glm-4.5")  # fmt: skip
GLM45_AIR = TinyArch("glm4moe", "Glm4MoeForCausalLM", tiny_glm45_air_config, write_glm4moe_from_hf,
                     _perturb_glm4moe, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_glm4moe,
                     "glm-4.5-air")  # fmt: skip
