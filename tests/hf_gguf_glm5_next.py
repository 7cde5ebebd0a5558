"""Tiny random GLM-5.3-Flash models (transformers' Glm5NextForConditionalGeneration, its text part) written
by llama.cpp's own converter (conversion/glm.py Glm5NextModel, tests/llama_cpp_converter.py): no mirror of
it here. The checkpoint is saved with save_pretrained (transformers writes the original layout: q/k/v
conv1d apart, hc_* names, one tensor per expert) and config.json gets the three fields the converter reads
that transformers does not write: linear_attn_config, mla_use_nope and first_k_dense_replace.

Other types than F32 are the converter's F32 file requantized here by the converter's own rule (what it
keeps in F32: 1-D tensors, norms, the router, the mHC and indexer-pool parameters, the KDA's conv and gates'
small tensors, the indexer's head weights); `tokenizer_md` replaces its tokenizer keys ({}: none).

The tiny shape: 5 blocks (KDA, attention full, attention shared, KDA, attention full), one leading dense
block, index top-k 32 in pools of 4 (8 pools a query), so the tests' prompts of 80 tokens and more attend to
a choice.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from moestream.formats.gguf_file import GGUFFile
from moestream.formats.gguf_write import array_tensor, write_gguf
from moestream.formats.quants import quantize
from moestream.streaming.expert_store import is_routed_expert_tensor
from tests.hf_gguf import _FILE_TYPE, TinyArch, tiny_vocab_size

INDEX_TOP_K, KPOOL = 32, 4
LAYER_TYPES = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"]
INDEXER_TYPES = ["full", "full", "shared", "full", "full"]


def tiny_glm5_next_config(**overrides: Any):
    from transformers import Glm5NextConfig

    text: dict[str, Any] = dict(
        vocab_size=tiny_vocab_size(), hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=0,
        qk_nope_head_dim=64, v_head_dim=64, norm_topk_prob=True, max_position_embeddings=4096,
        index_topk=INDEX_TOP_K, index_head_dim=64, index_n_heads=8, index_kpool=KPOOL, linear_head_dim=64,
        linear_num_heads=4, mlp_layer_types=["dense"] + ["sparse"] * 4, layer_types=LAYER_TYPES,
        indexer_types=INDEXER_TYPES, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    text.update(overrides)
    n = text["num_hidden_layers"]
    if n != 5 and "layer_types" not in overrides:  # every fourth block attends, as the real model's
        text["layer_types"] = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        text["indexer_types"] = ["full"] * n
        text["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=256,
                  projection_intermediate_size=64)  # fmt: skip
    cfg = Glm5NextConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"])
    for key in ("vocab_size", "num_hidden_layers", "num_experts_per_tok", "n_routed_experts"):
        setattr(cfg, key, text[key])  # where the shared tests (test_models.py) look for them
    return cfg


def perturb_glm5_next(model: Any) -> None:
    """Distinct norms; routers and correction biases large enough that the choice is never a near-tie; the
    indexer's head weights positive and its pool gates spread, so that its pool scores are seldom close at
    the top-k cut; the mHC weights of the checkpoints' size, so that the streams differ."""
    for name, p in model.named_parameters():
        if "visual" in name:
            continue
        if name.endswith("indexer.k_norm.bias"):
            p.uniform_(-0.2, 0.2)
        elif name.endswith(("index_kpool_compress_ape", "index_kpool_compress_gate")):
            p.normal_(0.0, 0.5)
        elif name.endswith(("_hc.base", "_hc.fn")):
            p.normal_(0.0, 0.1)
        elif name.endswith("dt_bias"):
            p.uniform_(-4.0, 0.0)
        elif p.ndim == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)
        elif name.endswith("indexer.weights_proj.weight"):
            p.normal_(0.0, 1.0).abs_()
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.uniform_(-0.2, 0.2)


def save_checkpoint(model: Any, directory: str | os.PathLike[str]) -> None:
    """save_pretrained, the tiny tokenizer, and config.json's fields the converter needs."""
    from tests.hf_checkpoint import write_tokenizer

    model.save_pretrained(directory)
    write_tokenizer(str(directory))
    path = Path(directory) / "config.json"
    conf = json.loads(path.read_text())
    t = conf["text_config"]
    t["linear_attn_config"] = {"num_heads": t["linear_num_heads"], "head_dim": t["linear_head_dim"],
                               "short_conv_kernel_size": t["linear_conv_kernel_dim"],
                               "gate_lower_bound": t["linear_lower_bound"]}  # fmt: skip
    t["mla_use_nope"] = True
    t["first_k_dense_replace"] = t["mlp_layer_types"].count("dense")
    path.write_text(json.dumps(conf))


def _stays_f32(name: str, ndim: int) -> bool:
    exact = ("hc_attn_", "hc_ffn_", "indexer_compressor_", "ssm_a", "ssm_dt", "exp_probs_b")
    return (ndim == 1 or "norm" in name or "ffn_gate_inp" in name or any(k in name for k in exact)
            or "ssm_conv1d" in name or name.endswith("indexer.proj.weight"))  # fmt: skip


def write_glm5_next_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
) -> None:
    """llama.cpp's converter on the saved model (F32), then its tensors requantized to (dense, expert)."""
    import pytest

    from tests.llama_cpp_converter import convert, converter_source

    vocab = model.config.text_config.vocab_size
    if vocab != tiny_vocab_size():
        raise ValueError(f"vocab_size {vocab} differs from the tiny BPE vocab ({tiny_vocab_size()})")
    src = converter_source()
    if src is None:
        pytest.skip("llama.cpp's converter could not be had: no network and no LLAMA_CPP_SRC")
    dense_t, expert_t = (T[t] if isinstance(t, str) else T(t) for t in (dense_type, expert_type))
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(model, tmp)
        f32 = Path(tmp) / "f32.gguf"
        convert(src, tmp, f32)
        _requantize(f32, path, dense_t, expert_t, tokenizer_md)


def _requantize(src: Path, dst: str | os.PathLike[str], dense_t: T, expert_t: T, tokenizer_md: dict | None) -> None:
    f = GGUFFile(src)
    try:
        md = {k: v for k, v in f.metadata.items() if not k.startswith("GGUF.") and k != "general.alignment"}
        if tokenizer_md is not None:
            md = {k: v for k, v in md.items() if not k.startswith("tokenizer.")} | tokenizer_md
        md["general.file_type"] = int(_FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32))
        specs = []
        for name, info in f.tensors.items():
            a = f.read(name).view(np.float32).reshape(info.shape)
            t = T.F32 if _stays_f32(name, len(info.shape)) else expert_t if is_routed_expert_tensor(name) else dense_t
            specs.append(array_tensor(name, t, a.shape, quantize(a, int(t)) if t != T.F32 else a))
        write_gguf(dst, f.arch, md, specs, progress=False)
    finally:
        f.close()


def _expected(c: Any) -> dict[str, Any]:
    t = c.text_config
    return {"n_blocks": t.num_hidden_layers, "hidden": t.hidden_size, "vocab_size": t.vocab_size,
            "n_heads": t.num_attention_heads, "kv_lora_rank": t.kv_lora_rank, "q_lora_rank": t.q_lora_rank,
            "qk_nope": t.qk_nope_head_dim, "qk_rope": 0, "v_head_dim": t.v_head_dim, "n_experts": t.n_routed_experts,
            "top_k": t.num_experts_per_tok, "expert_ffn": t.moe_intermediate_size, "kpool": t.index_kpool,
            "hc_mult": t.hc_mult, "nextn": 0}  # fmt: skip


GLM5_NEXT = TinyArch("glm5-next", "Glm5NextForConditionalGeneration", tiny_glm5_next_config, write_glm5_next_from_hf,
                     perturb_glm5_next, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected, "glm-5.3-flash")  # fmt: skip
