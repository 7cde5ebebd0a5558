"""Qwen3-MoE forward pass against transformers, and streaming never changing the output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from tests.hf_gguf import tiny_qwen3moe_config, write_qwen3moe_from_hf

transformers = pytest.importorskip("transformers")

PROMPT = [3, 17, 42, 99, 5, 61, 7, 128, 33, 250, 11, 2]


def _hf_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = tiny_qwen3moe_config(**overrides)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    return model


def _load_gguf_into_hf(model, path: str) -> None:
    """Set the HF model's weights to what the GGUF holds, decoded by gguf's reference dequantizer."""
    r = GGUFReader(path)
    t = {
        x.name: torch.from_numpy(np.array(gguf_dequantize(x.data, x.tensor_type), dtype=np.float32)) for x in r.tensors
    }
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"]}
    sd["lm_head.weight"] = t.get("output.weight", t["token_embd.weight"])
    for i in range(model.config.num_hidden_layers):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        sd[q + "input_layernorm.weight"] = t[p + "attn_norm.weight"]
        sd[q + "post_attention_layernorm.weight"] = t[p + "ffn_norm.weight"]
        for a, b in (
            ("attn_q", "q_proj"),
            ("attn_k", "k_proj"),
            ("attn_v", "v_proj"),
            ("attn_output", "o_proj"),
        ):
            sd[q + f"self_attn.{b}.weight"] = t[p + a + ".weight"]
        sd[q + "self_attn.q_norm.weight"] = t[p + "attn_q_norm.weight"]
        sd[q + "self_attn.k_norm.weight"] = t[p + "attn_k_norm.weight"]
        sd[q + "mlp.gate.weight"] = t[p + "ffn_gate_inp.weight"]
        sd[q + "mlp.experts.gate_up_proj"] = torch.cat([t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"]], 1)
        sd[q + "mlp.experts.down_proj"] = t[p + "ffn_down_exps.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [T.F32, T.F16])
def test_float_logits_match_transformers(tmp_path, dtype):
    model = _hf_model()
    path = str(tmp_path / "m.gguf")
    write_qwen3moe_from_hf(model, path, dense_type=dtype, expert_type=dtype)
    if dtype != T.F32:
        _load_gguf_into_hf(model, path)  # the reference computes from the same (rounded) weights
    ref = _hf_logits(model, PROMPT)
    eng = Engine(path, EngineOptions(n_slots=4))
    try:
        with torch.inference_mode():
            ours = eng.model.forward(PROMPT, eng.kv, 0, all_logits=True)
            assert _rel(ours, ref) < 1e-3
            # decoding token by token over the KV cache gives the same last-position logits
            eng.kv.truncate(0)
            for i, tok in enumerate(PROMPT):
                last = eng.model.forward([tok], eng.kv, i)
            assert _rel(last, ref[-1]) < 1e-3
    finally:
        eng.close()


@pytest.mark.parametrize("expert_type", [T.Q4_0, T.Q4_K, T.Q8_0, T.Q6_K])
def test_quantized_logits_match_gguf_reference(tmp_path, expert_type):
    model = _hf_model(seed=1)
    path = str(tmp_path / "q.gguf")
    write_qwen3moe_from_hf(model, path, dense_type=expert_type, expert_type=expert_type)
    _load_gguf_into_hf(model, path)
    ref = _hf_logits(model, PROMPT)[-1]
    eng = Engine(path, EngineOptions(n_slots=64))
    try:
        with torch.inference_mode():
            ours = eng.model.forward(PROMPT, eng.kv, 0)
        # bf16 activations on the quantized path: agreement at the bf16 level
        assert _rel(ours, ref) < 3e-2
        assert int(ours.argmax()) == int(ref.argmax())
    finally:
        eng.close()


@pytest.mark.parametrize("expert_type", [T.F32, T.Q4_K])
def test_streaming_never_changes_greedy_output(tmp_path, expert_type):
    model = _hf_model(seed=2)
    path = str(tmp_path / "s.gguf")
    write_qwen3moe_from_hf(model, path, dense_type=expert_type, expert_type=expert_type)
    cfg = model.config
    all_experts = cfg.num_hidden_layers * cfg.num_experts
    outputs, hit_rates = [], []
    for slots in (cfg.num_experts_per_tok, cfg.num_experts_per_tok + 3, all_experts):
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=5))
        try:
            gen = eng.generate(PROMPT, 24, Sampler())
            outputs.append(gen.tokens)
            hit_rates.append(gen.stats.hit_rate)
            assert eng.cache.used_slots <= slots
        finally:
            eng.close()
    assert outputs[0] == outputs[1] == outputs[2]
    assert hit_rates[0] < hit_rates[2]


def test_prompt_reuse_gives_same_tokens(tmp_path):
    model = _hf_model(seed=3)
    path = str(tmp_path / "r.gguf")
    write_qwen3moe_from_hf(model, path)
    eng = Engine(path, EngineOptions(n_slots=8))
    try:
        first = eng.generate(PROMPT, 6, Sampler())
        follow = PROMPT + first.tokens + [9, 10]
        reused = eng.generate(follow, 6, Sampler())
        assert reused.stats.reused_tokens >= len(PROMPT)
        eng.reset()
        fresh = eng.generate(follow, 6, Sampler())
        assert fresh.stats.reused_tokens == 0
        assert reused.tokens == fresh.tokens
    finally:
        eng.close()
