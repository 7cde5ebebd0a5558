"""The HF -> GGUF test converter writes what llama.cpp's converter would, and reads back exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from moestream.formats.gguf_file import GGUFFile
from tests.hf_gguf import tiny_qwen3moe_config, tiny_vocab_size, write_qwen3moe_from_hf

transformers = pytest.importorskip("transformers")


def _model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(tiny_qwen3moe_config(**overrides)).eval()
    with torch.no_grad():  # norms start at exactly 1: make them distinct so a mix-up shows
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model


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
    model = _model()
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


@pytest.mark.parametrize(
    "dense,expert,tol",
    [(T.F16, T.Q8_0, 0.01), (T.Q8_0, T.Q4_0, 0.15), (T.Q8_0, T.Q4_K, 0.15), (T.BF16, T.F32, 0.01)],
)
def test_quantized_types(tmp_path, dense, expert, tol):
    model = _model(seed=1)
    path = tmp_path / "q.gguf"
    write_qwen3moe_from_hf(model, path, dense_type=dense, expert_type=expert)
    r = GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    for name, (w, kind) in _expected(model).items():
        t = by_name[name]
        want = {"dense": dense, "expert": expert, "f32": T.F32}[kind]
        assert t.tensor_type == want, name
        got = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(w.shape)
        rel = np.linalg.norm(got - w) / np.linalg.norm(w)
        assert rel < (tol if kind != "f32" else 1e-7), (name, rel)


def test_tied_embeddings_omit_output(tmp_path):
    model = _model(seed=2, tie_word_embeddings=True)
    path = tmp_path / "tied.gguf"
    write_qwen3moe_from_hf(model, path, tokenizer_md={})
    f = GGUFFile(path)
    assert "output.weight" not in f.tensors and "token_embd.weight" in f.tensors
    assert not any(k.startswith("tokenizer.") for k in f.metadata)


def test_vocab_mismatch_is_explained(tmp_path):
    model = _model(vocab_size=tiny_vocab_size() + 3)
    with pytest.raises(ValueError, match="tiny BPE vocab"):
        write_qwen3moe_from_hf(model, tmp_path / "bad.gguf")
    assert not list(tmp_path.iterdir())
