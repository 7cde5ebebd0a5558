"""Tiny random GLM-5 and DeepSeek-V3.2 models (transformers' GlmMoeDsaForCausalLM, DeepseekV32ForCausalLM)
written as llama.cpp's converter writes glm-dsa and deepseek32 files (conversion/glm.py GlmMoeDsaModel,
conversion/deepseek.py DeepseekV32Model, both on DeepseekV2Model): deepseek2's tensors and keys under their
own architecture name, plus per block with an indexer blk.N.indexer.{attn_q_b, attn_k} (dense type),
indexer.k_norm.{weight, bias} and indexer.proj (F32: the converter keeps INDEXER_PROJ in float), and the
keys attention.indexer.{head_count, key_length, top_k} (glm-dsa: .types, true for a full block). GLM's
"shared" blocks have no indexer tensors.

The index top-k is 32 here, so the tests' 80-token prompts and their decode steps attend to a choice.
"""

from __future__ import annotations

import os
from typing import Any

from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from tests.hf_gguf import _FILE_TYPE, TinyArch, _f32_spec, _types, _weight, _write, tiny_vocab_size
from tests.hf_gguf_deepseek import _expected_deepseek2, deepseek2_metadata, deepseek2_specs

INDEX_TOP_K = 32


def _tiny_common(index_top_k: int) -> dict[str, Any]:
    return dict(
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
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        index_topk=index_top_k,
        index_head_dim=64,
        index_n_heads=8,
        tie_word_embeddings=False,
    )


def tiny_glm_dsa_config(**overrides: Any):
    """A small GlmMoeDsaConfig: GLM-5.2's full and shared indexer blocks (full, shared, full), sigmoid routing
    in one group, routed scaling 2.5, plain rope, one leading dense block."""
    from transformers import GlmMoeDsaConfig

    kw = _tiny_common(INDEX_TOP_K) | dict(n_group=1, topk_group=1, rms_norm_eps=1e-5,
                                          indexer_types=["full", "shared", "full"],
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    kw.update(overrides)
    if "num_hidden_layers" in overrides and "indexer_types" not in overrides:
        kw["indexer_types"] = ["full"] * overrides["num_hidden_layers"]
    return GlmMoeDsaConfig(**kw)


def tiny_deepseek_v32_config(**overrides: Any):
    """A small DeepseekV32Config: DeepSeek-V3's routing (4 groups, 2 used), YaRN as the tiny V3's, every block
    with its indexer."""
    from transformers import DeepseekV32Config

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    kw = _tiny_common(INDEX_TOP_K) | dict(n_group=4, topk_group=2, rms_norm_eps=1e-6, rope_parameters=yarn)
    kw.update(overrides)
    return DeepseekV32Config(**kw)


def dsa_metadata(cfg: Any, arch: str, file_type: int = 0) -> dict[str, Any]:
    """The converter's keys: DeepseekV2Model's under `arch`, the indexer's, and for deepseek32 the sigmoid
    gating of the real checkpoint's config.json (scoring_func; transformers writes none, and neither does
    GLM's, so a glm-dsa file has no expert_gating_func)."""
    base = deepseek2_metadata(cfg, f"tiny-{arch}", file_type)
    md = {k.replace("deepseek2.", f"{arch}.", 1): v for k, v in base.items()}
    md["general.architecture"] = arch
    a = arch + "."
    del md[a + "expert_gating_func"]
    if arch == "deepseek32":
        md[a + "expert_gating_func"] = 2
    md[a + "attention.indexer.head_count"] = cfg.index_n_heads
    md[a + "attention.indexer.key_length"] = cfg.index_head_dim
    md[a + "attention.indexer.top_k"] = cfg.index_topk
    if getattr(cfg, "indexer_types", None) is not None:
        md[a + "attention.indexer.types"] = [t == "full" for t in cfg.indexer_types]
    return md


def _indexer_specs(sd: dict, hf: str, p: str, dense_t: T) -> list:
    ix = hf + "self_attn.indexer."
    if ix + "wk.weight" not in sd:  # a shared block
        return []
    q = p + "indexer."
    return [_f32_spec(q + "k_norm.weight", sd[ix + "k_norm.weight"]),
            _f32_spec(q + "k_norm.bias", sd[ix + "k_norm.bias"]),
            _f32_spec(q + "proj.weight", sd[ix + "weights_proj.weight"]),
            _weight(q + "attn_k.weight", sd[ix + "wk.weight"], dense_t),
            _weight(q + "attn_q_b.weight", sd[ix + "wq_b.weight"], dense_t)]  # fmt: skip


def write_dsa_from_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    dense_type: int | str = T.F32,
    expert_type: int | str = T.F32,
    tokenizer_md: dict[str, Any] | None = None,
) -> None:
    """Write `model` (GlmMoeDsaForCausalLM or DeepseekV32ForCausalLM) as the converter writes it."""
    cfg = model.config
    arch = "glm-dsa" if cfg.model_type == "glm_moe_dsa" else "deepseek32"
    dense_t, expert_t = _types(dense_type, expert_type)
    specs = deepseek2_specs(model, dense_t, expert_t, extra=_indexer_specs)
    md = dsa_metadata(cfg, arch, _FILE_TYPE.get(expert_t, LlamaFileType.ALL_F32))
    _write(path, arch, md, specs, cfg.vocab_size, tokenizer_md)


def _perturb_dsa(model: Any) -> None:
    """Distinct norms; routers and correction biases large enough that the choice is never a near-tie; the
    indexer's head weights spread and positive, so that its scores are seldom close at the top-k cut and a
    key all of whose heads ReLU drops (score exactly 0) ranks last instead of tying others mid-row."""
    for name, p in model.named_parameters():
        if name.endswith("indexer.k_norm.bias"):  # a large shared offset would make the heads' signs agree
            p.uniform_(-0.2, 0.2)
        elif p.ndim == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)
        elif name.endswith("indexer.weights_proj.weight"):
            p.normal_(0.0, 1.0).abs_()
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.uniform_(-0.2, 0.2)


def _expected_dsa(c: Any) -> dict[str, Any]:
    return _expected_deepseek2(c) | {"nextn": 0}


GLM_DSA = TinyArch("glm-dsa", "GlmMoeDsaForCausalLM", tiny_glm_dsa_config, write_dsa_from_hf, _perturb_dsa,
                   ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_dsa, "glm-5")  # fmt: skip

DEEPSEEK_V32 = TinyArch("deepseek32", "DeepseekV32ForCausalLM", tiny_deepseek_v32_config, write_dsa_from_hf,
                        _perturb_dsa, ((T.F32, T.F32), (T.Q8_0, T.Q4_0)), _expected_dsa, "deepseek-v3.2")  # fmt: skip


def reference_cut_gaps(model: Any, toks: list[int]) -> Any:
    """Per position, the smallest gap between the top_k-th and the next index score of transformers' own
    indexers over every full block (inf where a query sees no more than top_k keys). Where it is within the
    reference's float32 rounding (its rope tables are float32 angles, about 1e-3 on these scores), the choice
    is a near-tie that any other rounding may settle the other way."""
    import torch
    import torch.nn.functional as F
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    rotate = apply_rotary_pos_emb_interleave if model.config.model_type == "glm_moe_dsa" else apply_rotary_pos_emb
    gaps, hooks = [], []

    def score(ix: Any, args: tuple, kwargs: dict) -> None:
        hs, qr, (cos, sin) = args[0], args[1], args[2]
        S, R, k_top = hs.shape[1], ix.qk_rope_head_dim, ix.index_topk
        q = ix.wq_b(qr).view(1, S, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(hs)).unsqueeze(2)
        q_rot, k_rot = rotate(q[..., :R], k[..., :R], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., R:]], -1), torch.cat([k_rot, k[..., R:]], -1).squeeze(2)
        s = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
        w = ix.weights_proj(hs).float() * ix.n_heads**-0.5
        sc = torch.matmul(w.unsqueeze(-2), s).squeeze(-2)[0]
        sc = sc.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        v = sc.sort(-1, descending=True).values
        gap = torch.full((S,), float("inf"))
        gap[k_top:] = v[k_top:, k_top - 1] - v[k_top:, k_top]
        gaps.append(gap)

    for m in model.modules():
        if type(m).__name__.endswith("Indexer"):
            hooks.append(m.register_forward_pre_hook(score, with_kwargs=True))
    try:
        with torch.no_grad():
            model(torch.tensor([toks]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(gaps).amin(0)
