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


# e2m1 values of the 16 codes (sign bit 3), as the MXFP4 checkpoints and transformers' dequantizer have them
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


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
    dense: bool = False  # no routed experts: the tests of streaming and routing do not apply

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


# V2-Lite's shape, written as converters before the k_b/v_b split did (one attn_kv_b)
