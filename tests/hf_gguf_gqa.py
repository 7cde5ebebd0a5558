"""Tiny random transformers models of the plain GQA MoE families written as llama.cpp's converter writes them
(tests/hf_gguf.py holds the others and the shared helpers):

- Mixtral (conversion/llama.py, LlamaModel): arch `llama`; q_proj/k_proj rows permuted into llama's rotary
  layout (LlamaModel.permute); the expert size as `llama.feed_forward_length`; `llama.vocab_size` and
  `llama.rope.dimension_count`; no sliding-window key. per_expert=True writes the older layout, one 2-D
  tensor per expert (`blk.N.ffn_gate.E.weight`, ...), interleaved gate/down/up per expert as old converters
  wrote them, so no two experts of a projection are adjacent in the file.
- OLMoE (conversion/olmo.py, OlmoeModel): arch `olmoe`; q/k norms over the whole projections; the expert
  size as `olmoe.feed_forward_length`; the rms epsilon always written as 1e-5.
- Qwen2-MoE (conversion/qwen.py, Qwen2MoeModel): arch `qwen2moe`; q/k/v biases; a shared expert with its
  sigmoid gate `ffn_gate_inp_shexp`; `expert_feed_forward_length` and `expert_shared_feed_forward_length`.
Every 1-D tensor, norm and router stays F32.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from tests.hf_gguf import TinyArch, _experts, _f32_spec, _rope_theta, _types, _weight, _write, tiny_vocab_size
from tests.hf_gguf_gpt_oss import _FILE_TYPE

ATTN = (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj"))


def tiny_mixtral_config(**overrides: Any):
    from transformers import MixtralConfig

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-5,
        sliding_window=None,  # llama.cpp's llama arch has none (see moestream/models/mixtral.py)
        tie_word_embeddings=False,
    )
    return MixtralConfig(**(kw | overrides))


def tiny_olmoe_config(**overrides: Any):
    from transformers import OlmoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # as OLMoE-1B-7B: llama.cpp's olmoe takes a k_norm of the full width only
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        rms_norm_eps=1e-5,  # what the converter writes whatever the config says
        tie_word_embeddings=False,
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    )
    return OlmoeConfig(**(kw | overrides))


def tiny_qwen2moe_config(**overrides: Any):
    from transformers import Qwen2MoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,  # Qwen1.5-MoE / Qwen2-57B; llama.cpp's qwen2moe never renormalises
        qkv_bias=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return Qwen2MoeConfig(**(kw | overrides))


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rotary halves interleaved into adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(arch: str, cfg: Any, file_type: int) -> dict[str, Any]:
    """The TextModel base keys (conversion/base.py) every one of the three gets."""
    a = arch + "."
    md = {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}",
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
        a + "expert_count": cfg.num_local_experts if arch == "llama" else cfg.num_experts,
        a + "expert_used_count": cfg.num_experts_per_tok,
    }
    if getattr(cfg, "head_dim", None) is not None:
        md[a + "attention.key_length"] = md[a + "attention.value_length"] = cfg.head_dim
    return md


def gqa_metadata(arch: str, cfg: Any, file_type: int = 0) -> dict[str, Any]:
    a = arch + "."
    md = _metadata(arch, cfg, file_type)
    if arch == "llama":
        md[a + "vocab_size"] = cfg.vocab_size
        md[a + "rope.dimension_count"] = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    elif arch == "olmoe":
        md[a + "attention.layer_norm_rms_epsilon"] = 1e-5
    elif arch == "qwen2moe":
        md[a + "expert_feed_forward_length"] = cfg.moe_intermediate_size
        md[a + "expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    return md


def write_gqa_moe_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    arch: str,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
    per_expert: bool = False,
) -> None:
    """Write `model` (MixtralForCausalLM for arch "llama", OlmoeForCausalLM, Qwen2MoeForCausalLM) as a GGUF.

    dense_type: embeddings, attention, shared expert and output; expert_type: the routed experts.
    per_expert (llama only): one tensor per expert instead of the merged `*_exps` tensors."""
    cfg = model.config
    dense_t, expert_t = _types(dense_type, expert_type)
    if arch == "qwen2moe" and (cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers):
        raise ValueError("qwen2moe GGUFs need every layer to be a MoE layer")
    if arch == "olmoe" and cfg.norm_topk_prob:
        raise ValueError("llama.cpp's olmoe never renormalises the top-k weights; use norm_topk_prob=False")
    sd = dict(model.state_dict())
    E = cfg.num_local_experts if arch == "llama" else cfg.num_experts
    ffn = cfg.moe_intermediate_size if arch == "qwen2moe" else cfg.intermediate_size
    specs = [_weight("token_embd.weight", sd["model.embed_tokens.weight"], dense_t)]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        specs.append(_f32_spec(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"]))
        for ours, theirs in ATTN:
            for kind in ("weight", "bias"):
                t = sd.get(f"{hf}self_attn.{theirs}.{kind}")
                if t is None:
                    continue
                if arch == "llama" and theirs in ("q_proj", "k_proj"):
                    t = llama_permute(t, cfg.num_attention_heads if theirs == "q_proj" else cfg.num_key_value_heads)
                name = f"{p}{ours}.{kind}"
                specs.append(_weight(name, t, dense_t) if kind == "weight" else _f32_spec(name, t))
        if arch == "olmoe":
            specs.append(_f32_spec(p + "attn_q_norm.weight", sd[hf + "self_attn.q_norm.weight"]))
            specs.append(_f32_spec(p + "attn_k_norm.weight", sd[hf + "self_attn.k_norm.weight"]))
        specs.append(_f32_spec(p + "ffn_norm.weight", sd[hf + "post_attention_layernorm.weight"]))
        specs.append(_f32_spec(p + "ffn_gate_inp.weight", sd[hf + "mlp.gate.weight"]))
        ex = _experts(sd, i, E, ffn)
        if per_expert:
            for e in range(E):
                for w in ("gate", "down", "up"):
                    specs.append(_weight(f"{p}ffn_{w}.{e}.weight", ex[w][e], expert_t))
        else:
            for w in ("gate", "up", "down"):
                specs.append(_weight(f"{p}ffn_{w}_exps.weight", ex[w], expert_t))
        if arch == "qwen2moe":
            specs.append(_f32_spec(p + "ffn_gate_inp_shexp.weight", sd[hf + "mlp.shared_expert_gate.weight"]))
            for w in ("gate", "up", "down"):
                specs.append(_weight(f"{p}ffn_{w}_shexp.weight", sd[f"{hf}mlp.shared_expert.{w}_proj.weight"], dense_t))
    specs.append(_f32_spec("output_norm.weight", sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        specs.append(_weight("output.weight", sd["lm_head.weight"], dense_t))
    md = gqa_metadata(arch, cfg, _FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32))
    _write(path, arch, md, specs, cfg.vocab_size, tokenizer_md)


# ---- the parametrized suite's cases (tests/test_models.py ARCH_CASES) --------------------------------


def _perturb(model: Any) -> None:
    """Distinct norms and biases; routers large enough that the choice is never a near-tie."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)


def _expected(c: Any) -> dict[str, Any]:
    mixtral = type(c).__name__ == "MixtralConfig"
    return {"n_layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab_size": c.vocab_size,
            "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "n_experts": c.num_local_experts if mixtral else c.num_experts, "top_k": c.num_experts_per_tok,
            "expert_ffn": getattr(c, "moe_intermediate_size", c.intermediate_size),
            "shared_ffn": getattr(c, "shared_expert_intermediate_size", 0), "norm_topk_prob": mixtral,
            "rms_eps": c.rms_norm_eps, "rope_theta": c.rope_parameters["rope_theta"]}  # fmt: skip


STREAM_TYPES = ((T.F32, T.F32), (T.Q8_0, T.Q4_0))
MIXTRAL = TinyArch("llama", "MixtralForCausalLM", tiny_mixtral_config,
                   functools.partial(write_gqa_moe_from_hf, arch="llama"), _perturb, STREAM_TYPES, _expected,
                   "mixtral")  # fmt: skip
MIXTRAL_PER_EXPERT = TinyArch("llama", "MixtralForCausalLM", tiny_mixtral_config,
                              functools.partial(write_gqa_moe_from_hf, arch="llama", per_expert=True), _perturb,
                              STREAM_TYPES, _expected, "mixtral-per-expert")  # fmt: skip
OLMOE = TinyArch("olmoe", "OlmoeForCausalLM", tiny_olmoe_config, functools.partial(write_gqa_moe_from_hf, arch="olmoe"),
                 _perturb, STREAM_TYPES, _expected)  # fmt: skip
QWEN2MOE = TinyArch("qwen2moe", "Qwen2MoeForCausalLM", tiny_qwen2moe_config,
                    functools.partial(write_gqa_moe_from_hf, arch="qwen2moe"), _perturb, STREAM_TYPES,
                    _expected)  # fmt: skip
