"""Tiny random transformers models of the dense families written as llama.cpp's converter writes them
(tests/hf_gguf.py holds the shared helpers):

- Llama / SmolLM2 (conversion/llama.py, LlamaModel): arch `llama` with no expert keys; q_proj/k_proj rows
  permuted into llama's rotary layout (LlamaModel.permute); `llama.vocab_size` and `llama.rope.dimension_count`.
- Qwen2 (conversion/qwen.py, Qwen2Model): arch `qwen2`; q/k/v biases, F32.
- Qwen3 (Qwen3Model, a Qwen2Model): arch `qwen3`; per-head q/k norms `attn_{q,k}_norm`, no biases.
Every writer: the TextModel base keys (conversion/base.py), key/value lengths where the config names a head
size, the FFN as `ffn_{gate,up,down}` of `feed_forward_length` rows, 1-D tensors F32, no `output` when the
embeddings are tied.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from tests.hf_gguf import TinyArch, _f32_spec, _rope_theta, _types, _weight, _write, tiny_vocab_size
from tests.hf_gguf_gpt_oss import _FILE_TYPE
from tests.hf_gguf_gqa import ATTN, llama_permute

_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def tiny_dense_config(arch: str, **overrides: Any):
    """A small config of `arch` whose sizes are multiples of 256 where a matrix's input needs it (Q4_K)."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kw["head_dim"] = 64
    if arch != "llama":
        kw["use_sliding_window"] = False
    return getattr(transformers, _CLASSES[arch])(**(kw | overrides))


def dense_metadata(arch: str, cfg: Any, file_type: int = 0) -> dict[str, Any]:
    a = arch + "."
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
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
    }
    if arch == "qwen3":  # the config names its head size
        md[a + "attention.key_length"] = md[a + "attention.value_length"] = head_dim
    if arch == "llama":
        md[a + "vocab_size"] = cfg.vocab_size
        md[a + "rope.dimension_count"] = head_dim
    return md


def write_dense_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    arch: str,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
) -> None:
    """Write `model` (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) as a GGUF of `arch`; dense_type:
    every matrix (expert_type: unused, there are no experts)."""
    cfg = model.config
    dense_t, _ = _types(dense_type, expert_type)
    sd = dict(model.state_dict())
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
        if arch == "qwen3":
            specs.append(_f32_spec(p + "attn_q_norm.weight", sd[hf + "self_attn.q_norm.weight"]))
            specs.append(_f32_spec(p + "attn_k_norm.weight", sd[hf + "self_attn.k_norm.weight"]))
        specs.append(_f32_spec(p + "ffn_norm.weight", sd[hf + "post_attention_layernorm.weight"]))
        for w in ("gate", "up", "down"):
            specs.append(_weight(f"{p}ffn_{w}.weight", sd[f"{hf}mlp.{w}_proj.weight"], dense_t))
    specs.append(_f32_spec("output_norm.weight", sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        specs.append(_weight("output.weight", sd["lm_head.weight"], dense_t))
    md = dense_metadata(arch, cfg, _FILE_TYPE.get(dense_t, LlamaFileType.ALL_F32))
    _write(path, arch, md, specs, cfg.vocab_size, tokenizer_md)


# ---- the parametrized suite's cases (tests/test_models.py ARCH_CASES) --------------------------------


def _perturb(model: Any) -> None:
    """Distinct norms and biases, so a mix-up or a wrong offset shows."""
    for _name, p in model.named_parameters():
        if p.ndim == 1:
            p.uniform_(0.5, 1.5)


def _expected(c: Any) -> dict[str, Any]:
    return {"n_blocks": c.num_hidden_layers, "n_layers": 0, "n_experts": 0, "top_k": 0, "hidden": c.hidden_size,
            "vocab_size": c.vocab_size, "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "ffn": c.intermediate_size, "rms_eps": c.rms_norm_eps,
            "rope_theta": c.rope_parameters["rope_theta"]}  # fmt: skip


def _case(arch: str, hf_class: str, label: str = "", **config: Any) -> TinyArch:
    return TinyArch(arch, hf_class, functools.partial(tiny_dense_config, arch, **config),
                    functools.partial(write_dense_from_hf, arch=arch), _perturb, ((T.F32, T.F32), (T.Q8_0, T.Q8_0)),
                    _expected, label, dense=True)  # fmt: skip


LLAMA = _case("llama", "LlamaForCausalLM", "llama-dense")
QWEN2 = _case("qwen2", "Qwen2ForCausalLM")
QWEN3 = _case("qwen3", "Qwen3ForCausalLM")
DENSE_CASES = [LLAMA, QWEN2, QWEN3]
