"""Test helper: a tiny random transformers Qwen3.5-MoE text model written as the GGUF llama.cpp would make.

Mirrors convert_hf_to_gguf.py (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase,
_Qwen35MRopeMixin, Qwen3_5MoeTextModel; base.py for the common keys and the F32 rules):
  - every `*norm.weight` except the DeltaNet's output norm gets +1 (HF computes x_hat * (1 + w));
  - A_log -> ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias; conv1d [C, 1, K] -> [C, K];
  - with fewer key than value heads, value heads go from grouped (by key head) to tiled order in
    in_proj_qkv's V rows, in_proj_z, in_proj_a/b, A_log, dt_bias, the conv's V channels and out_proj's
    columns, so value head h reads key head h % n_k;
  - 1-D tensors, norms, the router, the shared-expert gate and the conv kernel stay F32.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from moestream.formats.gguf_write import TensorSpec, array_tensor, write_gguf
from tests.hf_gguf import _FILE_TYPE, _experts, _f32, _quantizer, _rope_theta, tiny_tokenizer_metadata, tiny_vocab_size

ARCH = "qwen35moe"
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
        "general.architecture": ARCH,
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        f"{ARCH}.block_count": cfg.num_hidden_layers,
        f"{ARCH}.context_length": cfg.max_position_embeddings,
        f"{ARCH}.embedding_length": cfg.hidden_size,
        f"{ARCH}.attention.head_count": cfg.num_attention_heads,
        f"{ARCH}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{ARCH}.rope.freq_base": _rope_theta(cfg),
        f"{ARCH}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{ARCH}.expert_count": cfg.num_experts,
        f"{ARCH}.expert_used_count": cfg.num_experts_per_tok,
        f"{ARCH}.attention.key_length": head_dim,
        f"{ARCH}.attention.value_length": head_dim,
        f"{ARCH}.expert_feed_forward_length": cfg.moe_intermediate_size,
        f"{ARCH}.expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
        f"{ARCH}.ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        f"{ARCH}.ssm.state_size": cfg.linear_key_head_dim,
        f"{ARCH}.ssm.group_count": cfg.linear_num_key_heads,
        f"{ARCH}.ssm.time_step_rank": cfg.linear_num_value_heads,
        f"{ARCH}.ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
        # the converter reads the interval from the config file, where transformers does not keep it
        f"{ARCH}.full_attention_interval": int(getattr(cfg, "full_attention_interval", 4)),
        f"{ARCH}.rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 0.25)),
        f"{ARCH}.rope.dimension_sections": sections[:4],
    }
    if recurrent_layers:
        md[f"{ARCH}.attention.recurrent_layers"] = [t == "linear_attention" for t in cfg.layer_types]
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
    dense_t, expert_t = (T[t] if isinstance(t, str) else T(t) for t in (dense_type, expert_type))
    quantize = _quantizer()
    sd = dict(model.state_dict())

    def weight(name: str, w: torch.Tensor | np.ndarray, t: T) -> TensorSpec:
        a = _f32(w) if isinstance(w, torch.Tensor) else w
        return array_tensor(name, t, a.shape, quantize(a, int(t)))

    def f32(name: str, w: torch.Tensor) -> TensorSpec:
        a = _f32(w)
        return array_tensor(name, T.F32, a.shape, a)

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
        md[f"{ARCH}.full_attention_interval"] = full_attention_interval
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
        md[f"{ARCH}.block_count"] = n + 1
        md[f"{ARCH}.nextn_predict_layers"] = 1
        if recurrent_layers:
            md[f"{ARCH}.attention.recurrent_layers"] = md[f"{ARCH}.attention.recurrent_layers"] + [False]
    specs.append(norm("output_norm.weight", sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        specs.append(weight("output.weight", sd["lm_head.weight"], dense_t))

    if tokenizer_md is None:
        tokenizer_md = tiny_tokenizer_metadata()
        if len(tokenizer_md["tokenizer.ggml.tokens"]) != cfg.vocab_size:
            raise ValueError(
                f"vocab_size {cfg.vocab_size} differs from the tiny BPE vocab ({tiny_vocab_size()}); "
                "pass tokenizer_md={} to write no tokenizer"
            )
    write_gguf(path, ARCH, md | tokenizer_md, specs, progress=False)
