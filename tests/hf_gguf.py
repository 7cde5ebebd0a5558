"""Test helper: turn a tiny random transformers Qwen3-MoE model into the GGUF llama.cpp would make.

Mirrors convert_hf_to_gguf.py (Qwen2MoeModel / Qwen3MoeModel): the same tensor names, no q/k
permutation (qwen3moe uses NeoX rope, only llama-arch models are permuted), per-expert weights
stacked into [E, rows, cols] tensors, 1-D tensors and the router in F32, the same metadata keys.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from moestream.formats.gguf_write import TensorSpec, array_tensor, write_gguf

ARCH = "qwen3moe"

_FILE_TYPE = {
    T.F32: LlamaFileType.ALL_F32,
    T.F16: LlamaFileType.MOSTLY_F16,
    T.BF16: LlamaFileType.MOSTLY_BF16,
    T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    T.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    T.Q6_K: LlamaFileType.MOSTLY_Q6_K,
}


def _quantizer() -> Callable[[np.ndarray, int], np.ndarray]:
    try:
        from moestream.formats.quants import quantize

        return quantize
    except ImportError:  # before moestream.formats.quants existed; gguf has no K-quant encoder
        from gguf.quants import quantize as gq

        return lambda w, t: np.asarray(gq(w, T(t))).view(np.uint8)


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_metadata() -> dict[str, Any]:
    from moestream.formats.tokenizer import build_tiny_bpe_metadata

    return build_tiny_bpe_metadata()


def tiny_vocab_size() -> int:
    return len(tiny_tokenizer_metadata()["tokenizer.ggml.tokens"])


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
        "general.architecture": ARCH,
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        f"{ARCH}.block_count": cfg.num_hidden_layers,
        f"{ARCH}.context_length": cfg.max_position_embeddings,
        f"{ARCH}.embedding_length": cfg.hidden_size,
        f"{ARCH}.feed_forward_length": cfg.intermediate_size,
        f"{ARCH}.attention.head_count": cfg.num_attention_heads,
        f"{ARCH}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{ARCH}.rope.freq_base": _rope_theta(cfg),
        f"{ARCH}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{ARCH}.expert_used_count": cfg.num_experts_per_tok,
        f"{ARCH}.attention.key_length": head_dim,
        f"{ARCH}.attention.value_length": head_dim,
        f"{ARCH}.expert_count": cfg.num_experts,
        f"{ARCH}.expert_feed_forward_length": cfg.moe_intermediate_size,
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
    Norms, biases and the router stay F32 as in the converter. tokenizer_md: GGUF tokenizer keys;
    None writes the tiny BPE vocab (the config's vocab_size must match it), {} writes none.
    """
    cfg = model.config
    dense_t, expert_t = (T[t] if isinstance(t, str) else T(t) for t in (dense_type, expert_type))
    quantize = _quantizer()
    if cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers:
        raise ValueError(
            "qwen3moe GGUFs need every layer to be a MoE layer (decoder_sparse_step=1, no mlp_only_layers)"
        )
    sd = {k: v for k, v in model.state_dict().items()}

    def weight(name: str, w: np.ndarray, t: T) -> TensorSpec:
        return array_tensor(name, t, w.shape, quantize(w, int(t)))

    def f32(name: str, w: torch.Tensor) -> TensorSpec:
        a = _f32(w)
        return array_tensor(name, T.F32, a.shape, a)

    specs = [weight("token_embd.weight", _f32(sd["model.embed_tokens.weight"]), dense_t)]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        specs.append(f32(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"]))
        for ours, theirs in (
            ("attn_q", "q_proj"),
            ("attn_k", "k_proj"),
            ("attn_v", "v_proj"),
            ("attn_output", "o_proj"),
        ):
            specs.append(weight(f"{p}{ours}.weight", _f32(sd[f"{hf}self_attn.{theirs}.weight"]), dense_t))
            if (bias := sd.get(f"{hf}self_attn.{theirs}.bias")) is not None:
                specs.append(f32(f"{p}{ours}.bias", bias))
        specs.append(f32(p + "attn_q_norm.weight", sd[hf + "self_attn.q_norm.weight"]))
        specs.append(f32(p + "attn_k_norm.weight", sd[hf + "self_attn.k_norm.weight"]))
        specs.append(f32(p + "ffn_norm.weight", sd[hf + "post_attention_layernorm.weight"]))
        specs.append(f32(p + "ffn_gate_inp.weight", sd[hf + "mlp.gate.weight"]))  # the converter forces F32
        ex = _experts(sd, i, cfg.num_experts, cfg.moe_intermediate_size)
        for w in ("gate", "up", "down"):
            specs.append(weight(f"{p}ffn_{w}_exps.weight", ex[w], expert_t))
    specs.append(f32("output_norm.weight", sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        specs.append(weight("output.weight", _f32(sd["lm_head.weight"]), dense_t))

    md = qwen3moe_metadata(cfg, file_type=_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32))
    if tokenizer_md is None:
        tokenizer_md = tiny_tokenizer_metadata()
        if len(tokenizer_md["tokenizer.ggml.tokens"]) != cfg.vocab_size:
            raise ValueError(
                f"vocab_size {cfg.vocab_size} differs from the tiny BPE vocab ({tiny_vocab_size()}); "
                "pass tokenizer_md={} to write no tokenizer"
            )
    write_gguf(path, ARCH, md | tokenizer_md, specs, progress=False)
