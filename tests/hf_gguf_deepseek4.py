"""Tiny random DeepSeek-V4 models (transformers) written as llama.cpp's converter writes deepseek4 files
(conversion/deepseek.py DeepseekV4Model, from DeepSeek's own checkpoint layout; transformers' names map to
that layout by renames only, conversion_mapping.py), and that checkpoint layout itself, for the real
converter (test_deepseek4.py).

The converter: tensors keep their checkpoint shapes (no permutation: llama.cpp rotates V4's interleaved
pairs as they are); hash layers' tid2eid becomes an I32 `ffn_gate_tid2eid` [vocab, top_k] and their
gate.bias is dropped; the routed experts are repacked to MXFP4; float32 tensors stay F32. Here dense 2-D
weights take `dense_type`, routed experts `expert_type`; norms, sinks, the compressors' position biases, the
hyper-connection weights and the routers stay F32, as the checkpoint's float32 tensors do.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from moestream.formats.gguf_write import TensorSpec, array_tensor
from tests.hf_gguf import _FILE_TYPE, TinyArch, _experts, _f32_spec, _types, _weight, _write, tiny_vocab_size

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]  # fmt: skip
RATE = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def tiny_deepseek_v4_config(**overrides: Any):
    """A small DeepseekV4Config with every schedule entry (sliding, CSA, HCA), two hash layers, an indexer
    top-k of 4 (it drops entries past 16 tokens), a window of 16, YaRN on the compressed layers and a SwiGLU
    clip that bites. Sizes are multiples of 256 where Q4_K needs them; the indexer head is 64 (llama.cpp's
    Hadamard rotation needs at least that)."""
    from transformers import DeepseekV4Config

    n = overrides.pop("num_hidden_layers", len(LAYER_TYPES))
    kw: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(), hidden_size=256, moe_intermediate_size=256, num_hidden_layers=n,
        num_attention_heads=4, head_dim=64, q_lora_rank=64, partial_rotary_factor=0.25, n_routed_experts=8,
        num_experts_per_tok=2, routed_scaling_factor=1.5, layer_types=(LAYER_TYPES * n)[:n],
        mlp_layer_types=(["hash_moe"] * 2 + ["moe"] * n)[:n], sliding_window=16, o_groups=2, o_lora_rank=64,
        index_n_heads=16, index_head_dim=64, index_topk=4, num_nextn_predict_layers=0,
        max_position_embeddings=4096, swiglu_limit=0.15, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32.0, "beta_slow": 1.0},
    )  # fmt: skip
    kw.update(overrides)
    return DeepseekV4Config(**kw)


# transformers' names (after model.layers.{i}.) -> DeepSeek's checkpoint names (after layers.{i}.)
CHECKPOINT_NAMES = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
}
ROOT_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "head.weight", "model.hc_head.hc_fn": "hc_head_fn",
              "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}  # fmt: skip

# DeepSeek's checkpoint names -> the converter's GGUF names (its _map_dsv4_tensor_name)
GGUF_NAMES = {
    "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight",
    "attn.wq_b.weight": "attn_q_b.weight", "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wkv.weight": "attn_kv.weight", "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight", "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight", "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight", "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight", "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}  # fmt: skip
GGUF_ROOT = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "head.weight": "output.weight",
             "hc_head_fn": "output_hc_fn.weight", "hc_head_base": "output_hc_base.weight",
             "hc_head_scale": "output_hc_scale.weight"}  # fmt: skip


def checkpoint_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under DeepSeek's checkpoint names, routed experts as layers.{i}.ffn.experts.{e}.w1/w2/w3
    (gate, down, up), float32."""
    cfg = model.config
    sd = dict(model.state_dict())
    out: dict[str, torch.Tensor] = {}
    for hf, ds in ROOT_NAMES.items():
        if hf in sd and not (ds == "head.weight" and cfg.tie_word_embeddings):
            out[ds] = sd[hf]
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        for theirs, ds in CHECKPOINT_NAMES.items():
            if hf + theirs in sd:
                out[f"layers.{i}.{ds}"] = sd[hf + theirs]
        ex = _experts(sd, i, cfg.n_routed_experts, cfg.moe_intermediate_size)
        for e in range(cfg.n_routed_experts):
            for w, proj in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
                out[f"layers.{i}.ffn.experts.{e}.{w}.weight"] = torch.from_numpy(ex[proj][e])
    return out


def deepseek4_metadata(cfg: Any, name: str = "tiny-deepseek4", file_type: int = 0) -> dict[str, Any]:
    """The general.* and deepseek4.* keys the converter writes (TextModel's and DeepseekV4Model's)."""
    a = "deepseek4."
    rope = cfg.rope_parameters["compress"]
    n = cfg.num_hidden_layers
    md: dict[str, Any] = {
        "general.architecture": "deepseek4", "general.name": name, "general.file_type": int(file_type),
        "general.quantization_version": 2, a + "block_count": n, a + "context_length": cfg.max_position_embeddings,
        a + "embedding_length": cfg.hidden_size,
        a + "attention.head_count": cfg.num_attention_heads, a + "attention.head_count_kv": cfg.num_key_value_heads,
        a + "rope.freq_base": float(cfg.rope_parameters["main"]["rope_theta"]),
        a + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), a + "expert_count": cfg.n_routed_experts,
        a + "expert_used_count": cfg.num_experts_per_tok, a + "expert_gating_func": 4,
        a + "attention.key_length": cfg.head_dim, a + "attention.value_length": cfg.head_dim,
        a + "rope.dimension_count": cfg.qk_rope_head_dim, a + "attention.q_lora_rank": cfg.q_lora_rank,
        a + "attention.sliding_window": cfg.sliding_window,
        a + "expert_feed_forward_length": cfg.moe_intermediate_size, a + "expert_shared_count": cfg.n_shared_experts,
        a + "expert_weights_scale": float(cfg.routed_scaling_factor), a + "expert_weights_norm": cfg.norm_topk_prob,
        a + "swiglu_clamp_exp": [float(cfg.swiglu_limit)] * n, a + "swiglu_clamp_shexp": [float(cfg.swiglu_limit)] * n,
        a + "attention.indexer.head_count": cfg.index_n_heads, a + "attention.indexer.key_length": cfg.index_head_dim,
        a + "attention.indexer.top_k": cfg.index_topk, a + "attention.output_group_count": cfg.o_groups,
        a + "attention.output_lora_rank": cfg.o_lora_rank,
        a + "attention.compress_ratios": [RATE_OF(cfg, t) for t in cfg.layer_types],
        a + "attention.compress_rope_freq_base": float(rope["rope_theta"]), a + "hyper_connection.count": cfg.hc_mult,
        a + "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        a + "hyper_connection.epsilon": float(cfg.hc_eps),
        a + "hash_layer_count": cfg.mlp_layer_types.count("hash_moe"),
        a + "embedding_length_out": cfg.hidden_size * cfg.hc_mult,
    }  # fmt: skip
    if rope.get("rope_type") == "yarn":
        md |= {a + "rope.scaling.type": "yarn", a + "rope.scaling.factor": float(rope["factor"]),
               a + "rope.scaling.original_context_length": int(rope["original_max_position_embeddings"]),
               a + "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
               a + "rope.scaling.yarn_beta_slow": float(rope["beta_slow"])}  # fmt: skip
    return md


def RATE_OF(cfg: Any, layer_type: str) -> int:  # noqa: N802 - reads like the table it stands for
    return 0 if layer_type == "sliding_attention" else int(cfg.compress_rates[layer_type])


def write_deepseek4_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
) -> None:
    """Write `model` (transformers DeepseekV4ForCausalLM) as a deepseek4 GGUF (see the module docstring)."""
    cfg = model.config
    dense_t, expert_t = _types(dense_type, expert_type)
    ck = checkpoint_tensors(model)
    specs: list[TensorSpec] = []
    for ds, t in ck.items():
        if ".ffn.experts." in ds:
            continue
        if ds.startswith("layers."):
            _, i, rest = ds.split(".", 2)
            if rest == "ffn.gate.tid2eid":
                a = t.to(torch.int32).contiguous().numpy()
                specs.append(array_tensor(f"blk.{i}.ffn_gate_tid2eid.weight", T.I32, a.shape, a))
                continue
            if rest == "ffn.gate.bias" and cfg.mlp_layer_types[int(i)] == "hash_moe":
                continue
            name = f"blk.{i}.{GGUF_NAMES[rest]}"
        else:
            name = GGUF_ROOT[ds]
        f32 = t.ndim < 2 or "ape" in ds or "hc_" in ds or "ffn.gate." in ds
        specs.append(_f32_spec(name, t) if f32 else _weight(name, t, dense_t))
    sd = dict(model.state_dict())
    for i in range(cfg.num_hidden_layers):
        ex = _experts(sd, i, cfg.n_routed_experts, cfg.moe_intermediate_size)
        for w in ("gate", "up", "down"):
            specs.append(_weight(f"blk.{i}.ffn_{w}_exps.weight", ex[w], expert_t))
    md = deepseek4_metadata(cfg, file_type=_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32))
    _write(path, "deepseek4", md, specs, cfg.vocab_size, tokenizer_md)


def _expected_deepseek4(c: Any) -> dict[str, Any]:
    return {"n_layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab_size": c.vocab_size,
            "n_heads": c.num_attention_heads, "head_dim": c.head_dim, "rope_dim": c.qk_rope_head_dim,
            "q_lora_rank": c.q_lora_rank, "window": c.sliding_window, "o_groups": c.o_groups,
            "n_experts": c.n_routed_experts, "top_k": c.num_experts_per_tok, "expert_ffn": c.moe_intermediate_size,
            "n_hash": c.mlp_layer_types.count("hash_moe"), "hc_mult": c.hc_mult, "index_topk": c.index_topk,
            "ratios": tuple(RATE_OF(c, t) for t in c.layer_types), "rms_eps": c.rms_norm_eps}  # fmt: skip


def _perturb_deepseek4(model: Any) -> None:
    """Distinct norms, sinks, position biases and hyper-connection weights; routers large enough that the
    choice is never a near-tie; hash tables that send each token to distinct experts."""
    cfg = model.config
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if "norm" in name and p.ndim == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith(("sinks", "position_bias")):
            p.normal_(0.0, 0.5)
        elif name.endswith((".base", "hc_base")):
            p.normal_(0.0, 0.5)
        elif name.endswith((".scale", "hc_scale")):
            p.uniform_(0.5, 1.5)
        elif name.endswith(("attn_hc.fn", "ffn_hc.fn", "hc_fn")):
            p.normal_(0.0, 0.1)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.uniform_(-0.2, 0.2)
        elif name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)]))  # fmt: skip


DEEPSEEK_V4 = TinyArch("deepseek4", "DeepseekV4ForCausalLM", tiny_deepseek_v4_config, write_deepseek4_from_hf,
                       _perturb_deepseek4, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_deepseek4,
                       "deepseek-v4")  # fmt: skip


# ---- DeepSeek's own checkpoint layout, for llama.cpp's converter ------------------------------------


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., cols] (cols a multiple of 32) as DeepSeek's FP4 experts hold it: (the values it then stands for,
    the e2m1 codes packed two a byte (element 2i low nibble, 2i+1 high) [..., cols / 2], one E8M0 exponent
    byte per 32 values [..., cols / 32])."""
    from tests.hf_gguf import E2M1

    table = torch.from_numpy(E2M1)
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    top = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    e = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    codes = (g / 2**e).unsqueeze(-1).sub(table).abs().argmin(dim=-1)
    values = (table[codes] * 2**e).reshape(w.shape)
    flat = codes.reshape(*w.shape[:-1], -1, 2).to(torch.uint8)
    packed = (flat[..., 0] | (flat[..., 1] << 4)).contiguous()
    return values, packed, (e.squeeze(-1) + 127).to(torch.uint8)


def snap_experts_to_mxfp4(model: Any) -> None:
    """Every routed expert's weights replaced by the MXFP4 values they round to: the converter's file then
    holds them exactly."""
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.copy_(mxfp4(p)[0])


def deepseek_config_json(cfg: Any) -> dict[str, Any]:
    """The config.json DeepSeek ships with a V4 checkpoint (its own key names), for this config."""
    rope = cfg.rope_parameters["compress"]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_parameters["main"]["rope_theta"],
        "rope_scaling": {"type": "yarn", "factor": rope["factor"],
                         "original_max_position_embeddings": rope["original_max_position_embeddings"],
                         "beta_fast": rope["beta_fast"], "beta_slow": rope["beta_slow"]},
        "compress_ratios": [RATE_OF(cfg, t) for t in cfg.layer_types], "compress_rope_theta": rope["rope_theta"],
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "num_hash_layers": cfg.mlp_layer_types.count("hash_moe"), "swiglu_limit": cfg.swiglu_limit,
        "sliding_window": cfg.sliding_window, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "num_nextn_predict_layers": 0, "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1,
    }  # fmt: skip


def write_deepseek_checkpoint(model: Any, folder: str | os.PathLike[str]) -> None:
    """`model` (its experts snapped to MXFP4) as DeepSeek's checkpoint: config.json and model.safetensors, the
    routed experts as FP4 codes (uint8, two a byte) with E8M0 scales (`.scale`), tid2eid int32, everything else
    float32 (which the converter keeps F32)."""
    import json

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in checkpoint_tensors(model).items():
        if ".ffn.experts." in name:
            values, packed, scale = mxfp4(t)
            assert torch.equal(values, t.float()), f"{name} is not on the MXFP4 grid (snap_experts_to_mxfp4)"
            tensors[name] = packed
            tensors[name.removesuffix(".weight") + ".scale"] = scale
        elif name.endswith("tid2eid"):
            tensors[name] = t.to(torch.int32).contiguous()
        else:
            tensors[name] = t.float().contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(deepseek_config_json(model.config), f)
