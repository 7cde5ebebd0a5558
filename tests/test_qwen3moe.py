"""Qwen3-MoE only: the test converter's exact tensor mapping, and logits from rounded (F16, quantized)
weights against transformers computing from the same weights. The rest is in test_models.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.formats.gguf_file import GGUFFile
from tests.hf_gguf import QWEN3MOE, rel_error, tiny_vocab_size, write_qwen3moe_from_hf

transformers = pytest.importorskip("transformers")

PROMPT = [3, 17, 42, 99, 5, 61, 7, 128, 33, 250, 11, 2]


def _hf_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(QWEN3MOE.config(**overrides)).eval()


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


def test_f16_logits_match_transformers(tmp_path):
    model = _hf_model()
    path = str(tmp_path / "m.gguf")
    write_qwen3moe_from_hf(model, path, dense_type=T.F16, expert_type=T.F16)
    _load_gguf_into_hf(model, path)  # the reference computes from the same (rounded) weights
    ref = _hf_logits(model, PROMPT)
    eng = Engine(path, EngineOptions(n_slots=4))
    try:
        with torch.inference_mode():
            ours = eng.forward(PROMPT, 0, all_logits=True)
            assert rel_error(ours, ref) < 1e-3
            # decoding token by token over the KV cache gives the same last-position logits
            eng.kv.truncate(0)
            for i, tok in enumerate(PROMPT):
                last = eng.forward([tok], i)
            assert rel_error(last, ref[-1]) < 1e-3
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
            ours = eng.forward(PROMPT, 0)
        # bf16 activations on the quantized path: agreement at the bf16 level
        assert rel_error(ours, ref) < 3e-2
        assert int(ours.argmax()) == int(ref.argmax())
    finally:
        eng.close()


def _expected(model) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (float32 weight, 'dense' | 'expert' | 'f32')."""
    cfg, sd = model.config, {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    F = cfg.moe_intermediate_size
    out = {"token_embd.weight": (sd["model.embed_tokens.weight"], "dense")}
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        gate_up = sd[hf + "mlp.experts.gate_up_proj"]
        out |= {
            p + "attn_norm.weight": (sd[hf + "input_layernorm.weight"], "f32"),
            p + "attn_q.weight": (sd[hf + "self_attn.q_proj.weight"], "dense"),
            p + "attn_k.weight": (sd[hf + "self_attn.k_proj.weight"], "dense"),
            p + "attn_v.weight": (sd[hf + "self_attn.v_proj.weight"], "dense"),
            p + "attn_output.weight": (sd[hf + "self_attn.o_proj.weight"], "dense"),
            p + "attn_q_norm.weight": (sd[hf + "self_attn.q_norm.weight"], "f32"),
            p + "attn_k_norm.weight": (sd[hf + "self_attn.k_norm.weight"], "f32"),
            p + "ffn_norm.weight": (sd[hf + "post_attention_layernorm.weight"], "f32"),
            p + "ffn_gate_inp.weight": (sd[hf + "mlp.gate.weight"], "f32"),
            p + "ffn_gate_exps.weight": (gate_up[:, :F], "expert"),
            p + "ffn_up_exps.weight": (gate_up[:, F:], "expert"),
            p + "ffn_down_exps.weight": (sd[hf + "mlp.experts.down_proj"], "expert"),
        }
    out["output_norm.weight"] = (sd["model.norm.weight"], "f32")
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (sd["lm_head.weight"], "dense")
    return out


def test_f32_roundtrip_is_exact(tmp_path):
    model = QWEN3MOE.hf_model()
    cfg = model.config
    path = tmp_path / "m.gguf"
    write_qwen3moe_from_hf(model, path)
    expected = _expected(model)

    f = GGUFFile(path)
    assert f.arch == "qwen3moe"
    assert set(f.tensors) == set(expected)
    md = f.metadata
    H, hd, E, F = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    assert md["qwen3moe.block_count"] == cfg.num_hidden_layers
    assert md["qwen3moe.embedding_length"] == H
    assert md["qwen3moe.feed_forward_length"] == cfg.intermediate_size
    assert md["qwen3moe.attention.head_count"] == cfg.num_attention_heads
    assert md["qwen3moe.attention.head_count_kv"] == cfg.num_key_value_heads
    assert md["qwen3moe.attention.key_length"] == md["qwen3moe.attention.value_length"] == hd
    assert md["qwen3moe.expert_count"] == E
    assert md["qwen3moe.expert_used_count"] == cfg.num_experts_per_tok
    assert md["qwen3moe.expert_feed_forward_length"] == F
    assert md["qwen3moe.context_length"] == cfg.max_position_embeddings
    assert md["qwen3moe.rope.freq_base"] == pytest.approx(1e6)
    assert md["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert len(md["tokenizer.ggml.tokens"]) == cfg.vocab_size == tiny_vocab_size()
    assert "tokenizer.chat_template" in md

    assert f.tensors["blk.0.ffn_gate_exps.weight"].shape == (E, F, H)
    assert f.tensors["blk.0.ffn_down_exps.weight"].shape == (E, H, F)
    assert f.tensors["blk.1.attn_q.weight"].shape == (cfg.num_attention_heads * hd, H)
    assert f.tensors["blk.1.attn_k.weight"].shape == (cfg.num_key_value_heads * hd, H)
    assert f.tensors["blk.1.attn_output.weight"].shape == (H, cfg.num_attention_heads * hd)
    assert f.tensors["token_embd.weight"].shape == (cfg.vocab_size, H)
    for name, (w, _) in expected.items():
        info = f.tensors[name]
        assert info.shape == w.shape, name
        assert info.ggml_type == T.F32, name
        got = f.read(name).view(np.float32).reshape(info.shape)
        np.testing.assert_array_equal(got, w, err_msg=name)  # q/k are not permuted for qwen3moe

    # gguf's own reader agrees (shapes are reversed there: ggml order)
    r = GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    for name, (w, _) in expected.items():
        t = by_name[name]
        assert tuple(reversed(t.shape.tolist())) == w.shape
        np.testing.assert_array_equal(np.asarray(t.data).reshape(w.shape), w)
    f.close()
