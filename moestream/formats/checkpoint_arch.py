"""config.json -> llama.cpp's metadata keys, and each checkpoint tensor -> its GGUF name, shape and bytes,
as convert_hf_to_gguf.py maps them, for the architectures a checkpoint directory may hold.

Copies are byte ranges (BF16, F16, F32 tensors keep their type: GGUF's BF16/F16/F32 rows are the same
bytes); the converter's changes are `convert` functions on the range's bytes (formats/checkpoint.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from moestream.compute import kernels
from moestream.errors import ModelFileError
from moestream.formats import quants

TYPES = {"F32": int(T.F32), "F16": int(T.F16), "BF16": int(T.BF16)}
ELEM = {int(T.F32): 4, int(T.F16): 2, int(T.BF16): 2}
FP8 = "F8_E4M3"


class Config:
    """Typed reads of config.json: a missing or wrong value is one ModelFileError naming the key."""

    def __init__(self, cfg: dict[str, Any], source: str):
        self.cfg, self.source = cfg, source

    def int(self, key: str, default: Any = None) -> int:
        v = self.cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelFileError(f"{self.source}: config.json's {key} is {v!r}; it must be a whole number > 0")
        return v

    def experts(self) -> int:
        """Routed experts per layer: num_experts in the released Qwen configs, num_local_experts elsewhere."""
        return self.int("num_experts" if "num_experts" in self.cfg else "num_local_experts")

    def float(self, key: str, default: Any = None) -> float:
        v = self.cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ModelFileError(f"{self.source}: config.json's {key} is {v!r}; it must be a number")
        return float(v)

    def rope(self) -> dict[str, Any]:
        """rope_parameters (transformers 5) or rope_scaling with rope_theta beside it (the released configs)."""
        params = self.cfg.get("rope_parameters") or self.cfg.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ModelFileError(f"{self.source}: config.json's rope_parameters is not an object")
        return {"rope_theta": self.cfg.get("rope_theta", 10000.0)} | params

    def head_dim(self) -> int:
        return self.int("head_dim", None) if self.cfg.get("head_dim") else self.int("hidden_size") // self.int(
            "num_attention_heads")  # fmt: skip


def _block_size(m: Any) -> tuple[int, int]:
    q = m.config.get("quantization_config") or {}
    size = q.get("weight_block_size") or [128, 128]
    if q and q.get("quant_method") not in (None, "fp8"):
        raise ModelFileError(f"{m.path}: quantization_config quant_method {q.get('quant_method')!r} is not supported "
                             "(supported: fp8 with block scales, or the MXFP4 experts GPT-OSS ships)")  # fmt: skip
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)):
        raise ModelFileError(f"{m.path}: quantization_config weight_block_size is {size!r}, not [rows, cols]")
    return size[0], size[1]


def _fp8(m: Any, hf: str, n: int, k: int) -> tuple[Callable[[np.ndarray], np.ndarray], int]:
    """(convert, type): FP8 bytes and their block scales (`weight_scale_inv`, kept in memory: 1/16384 of the
    weights' count) -> the FP8 compute form (quants.FP8_B128: 1 byte a weight, computed at its own bits) where
    the scales' blocks are 128 columns wide and rows whole blocks, as DeepSeek's and Qwen's are; else -> bf16
    bytes, the products rounded (in C)."""
    scale_name = hf + "_scale_inv"
    _, st = m.source(scale_name)
    raw = m.read_source(scale_name)
    if st.dtype == "F32":
        scales = raw.view(np.float32)
    elif st.dtype == "BF16":
        scales = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ModelFileError(f"{m.path}: {scale_name} is {st.dtype}; block scales must be F32 or BF16")
    block = _block_size(m)
    want = (-(-n // block[0]), -(-k // block[1]))
    if st.shape != want:
        raise ModelFileError(f"{m.path}: {scale_name} has shape {list(st.shape)}, expected {list(want)} for "
                             f"[{n}, {k}] in {block[0]}x{block[1]} blocks")  # fmt: skip
    scales = scales.reshape(want).copy()
    if block[1] == 128 and k % 128 == 0:
        return functools.partial(kernels.fp8_pack, n=n, k=k, scales=scales, rows_per_scale=block[0]), quants.FP8_B128
    decode = functools.partial(kernels.fp8_block_decode, n=n, k=k, scales=scales, block=block, bf16=True)
    return decode, int(T.BF16)


def _permute_rows(raw: np.ndarray, n_head: int, row_bytes: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute on whole rows: each head's two rotary halves interleaved."""
    rows = raw.reshape(-1, row_bytes)
    n = rows.shape[0]
    out = rows.reshape(n_head, 2, n // n_head // 2, row_bytes).swapaxes(1, 2).reshape(n, row_bytes)
    return np.ascontiguousarray(out).reshape(-1)


def weight(m: Any, name: str, hf: str, permute_heads: int | None = None) -> None:
    """GGUF tensor `name` from checkpoint tensor `hf`: its bytes, FP8 decoded, llama's q/k rows permuted."""
    _, st = m.source(hf)
    convert = None
    if st.dtype == FP8:
        if len(st.shape) != 2:
            raise ModelFileError(f"{m.path}: {hf} is FP8 with shape {list(st.shape)}; only matrices can be")
        convert, ggml_type = _fp8(m, hf, *st.shape)
    elif st.dtype in TYPES:
        ggml_type = TYPES[st.dtype]
    else:
        raise ModelFileError(f"{m.path}: {hf} is {st.dtype}, which moestream cannot compute (BF16, F16, F32, FP8)")
    if permute_heads is not None:
        row_bytes = quants.row_nbytes(ggml_type, st.shape[-1] if len(st.shape) == 2 else 1)
        first = convert

        def convert(raw, first=first):  # noqa: E306
            return _permute_rows(raw if first is None else first(raw), permute_heads, row_bytes)

    m.add(name, ggml_type, st.shape, hf, convert)


def builder_for(config: dict[str, Any], directory: str) -> Callable[[Any], tuple[str, dict[str, Any]]]:
    from moestream.formats import checkpoint_gpt_oss

    archs = config.get("architectures") or [None]
    builders = {"Qwen3MoeForCausalLM": qwen3moe, "MixtralForCausalLM": mixtral,
                "GptOssForCausalLM": checkpoint_gpt_oss.gpt_oss}  # fmt: skip
    build = builders.get(archs[0]) if isinstance(archs, list) else None
    if build is None:
        raise ModelFileError(f"{directory}: architecture {archs[0]!r} (config.json) is not supported for "
                             f"checkpoint directories (supported: {', '.join(sorted(builders))})")  # fmt: skip
    return build


def _common(arch: str, c: Config) -> dict[str, Any]:
    """The TextModel base keys of the converter."""
    a = arch + "."
    return {"general.architecture": arch, "general.name": c.cfg.get("_name_or_path") or arch,
            a + "block_count": c.int("num_hidden_layers"), a + "context_length": c.int("max_position_embeddings", 4096),
            a + "embedding_length": c.int("hidden_size"), a + "feed_forward_length": c.int("intermediate_size"),
            a + "attention.head_count": c.int("num_attention_heads"),
            a + "attention.head_count_kv": c.int("num_key_value_heads", c.cfg.get("num_attention_heads")),
            a + "rope.freq_base": float(c.rope()["rope_theta"]),
            a + "attention.layer_norm_rms_epsilon": c.float("rms_norm_eps"),
            a + "expert_used_count": c.int("num_experts_per_tok"),
            a + "attention.key_length": c.head_dim(), a + "attention.value_length": c.head_dim()}  # fmt: skip


def _ends(m: Any, c: Config) -> None:
    weight(m, "token_embd.weight", "model.embed_tokens.weight")
    weight(m, "output_norm.weight", "model.norm.weight")
    if not c.cfg.get("tie_word_embeddings", False):
        weight(m, "output.weight", "lm_head.weight")


def _attention(m: Any, i: int, permute: tuple[int, int] | None = None) -> None:
    hf, p = f"model.layers.{i}.self_attn.", f"blk.{i}."
    for ours, theirs, heads in (("attn_q", "q_proj", 0), ("attn_k", "k_proj", 1), ("attn_v", "v_proj", None),
                                ("attn_output", "o_proj", None)):  # fmt: skip
        weight(
            m, f"{p}{ours}.weight", f"{hf}{theirs}.weight", None if permute is None or heads is None else permute[heads]
        )
        if m.has_source(f"{hf}{theirs}.bias"):
            weight(
                m, f"{p}{ours}.bias", f"{hf}{theirs}.bias", None if permute is None or heads is None else permute[heads]
            )


def _experts(m: Any, i: int, n_experts: int, hf: str, names: tuple[str, str, str]) -> None:
    """One GGUF tensor per expert (blk.i.ffn_gate.e.weight): each its own byte range, as the cache reads it."""
    for e in range(n_experts):
        for proj, theirs in zip(("gate", "up", "down"), names, strict=True):
            weight(m, f"blk.{i}.ffn_{proj}.{e}.weight", f"{hf}{e}.{theirs}.weight")


def qwen3moe(m: Any) -> tuple[str, dict[str, Any]]:
    c = Config(m.config, m.path)
    if c.cfg.get("decoder_sparse_step", 1) != 1 or c.cfg.get("mlp_only_layers"):
        raise ModelFileError(f"{m.path}: every layer must be a MoE layer (decoder_sparse_step 1, no mlp_only_layers)")
    md = _common("qwen3moe", c) | {"qwen3moe.expert_count": c.experts(),
                                   "qwen3moe.expert_feed_forward_length": c.int("moe_intermediate_size")}  # fmt: skip
    _ends(m, c)
    for i in range(c.int("num_hidden_layers")):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        weight(m, p + "attn_norm.weight", hf + "input_layernorm.weight")
        _attention(m, i)
        weight(m, p + "attn_q_norm.weight", hf + "self_attn.q_norm.weight")
        weight(m, p + "attn_k_norm.weight", hf + "self_attn.k_norm.weight")
        weight(m, p + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        weight(m, p + "ffn_gate_inp.weight", hf + "mlp.gate.weight")
        _experts(m, i, c.experts(), hf + "mlp.experts.", ("gate_proj", "up_proj", "down_proj"))
    return "qwen3moe", md


def mixtral(m: Any) -> tuple[str, dict[str, Any]]:
    """llama arch, q/k rows permuted into llama's rotary layout as the converter does (the model puts them
    back at load: gqa.unpermute_rows)."""
    c = Config(m.config, m.path)
    md = _common("llama", c) | {"llama.expert_count": c.experts(), "llama.vocab_size": c.int("vocab_size"),
                                "llama.rope.dimension_count": c.head_dim()}  # fmt: skip
    _ends(m, c)
    heads = (c.int("num_attention_heads"), c.int("num_key_value_heads", c.cfg.get("num_attention_heads")))
    for i in range(c.int("num_hidden_layers")):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        weight(m, p + "attn_norm.weight", hf + "input_layernorm.weight")
        _attention(m, i, heads)
        weight(m, p + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        weight(m, p + "ffn_gate_inp.weight", hf + "block_sparse_moe.gate.weight")
        _experts(m, i, c.experts(), hf + "block_sparse_moe.experts.", ("w1", "w3", "w2"))
    return "llama", md
