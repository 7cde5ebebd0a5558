"""Synthetic gpt-oss, Mixtral (llama), OLMoE and Qwen2-MoE models: the tensor table and keys llama.cpp's
converter writes, the quant mixes llama-quantize picks (gpt-oss experts MXFP4 in every quantized one), real
sizes, and moestream and llama.cpp computing the same model from them."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.formats.gguf_file import GGUFFile
from moestream.formats.tokenizer import build_tiny_bpe_metadata
from moestream.synth.blocks import random_blocks
from moestream.synth.gqa_arches import HARMONY_TOKENS, GqaShape, harmony_tokenizer_metadata
from moestream.synth.shapes import SHAPES, synth_nbytes, use_more_bits, write_synth
from tests.hf_gguf import one_torch_thread, rel_error
from tests.test_synth_deepseek import _llama_run, plain_llama_cpp

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)
TINY = ["tiny-gpt-oss", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2moe", "tiny-minimax-m2"]
REAL = ["gpt-oss-20b", "gpt-oss-120b", "mixtral-8x7b", "olmoe-1b-7b", "qwen2-57b-a14b", "minimax-m2"]
PROMPT = list(range(20, 60))  # longer than tiny-gpt-oss's window of 24


def _vocab(s: GqaShape) -> int:
    return len(s.tokenizer_metadata()["tokenizer.ggml.tokens"])


def _table(s: GqaShape, vocab: int) -> dict[str, tuple[int, ...]]:
    """The shapes llama.cpp's loader for the arch asks for (numpy order), optional biases as each has them."""
    H, D, E, F = s.hidden, s.head_dim, s.n_experts, s.expert_ffn
    q, kv = s.n_heads * D, s.n_kv_heads * D
    oss = s.arch == "gpt-oss"
    out = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "output.weight": (vocab, H)}
    for i in range(s.n_layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": (H,), p + "attn_q.weight": (q, H), p + "attn_k.weight": (kv, H),
                p + "attn_v.weight": (kv, H), p + "attn_output.weight": (H, q), p + "ffn_gate_inp.weight": (E, H),
                p + "ffn_gate_exps.weight": (E, F, H), p + "ffn_up_exps.weight": (E, F, H),
                p + "ffn_down_exps.weight": (E, H, F)}  # fmt: skip
        out[p + ("post_attention_norm.weight" if oss else "ffn_norm.weight")] = (H,)
        if oss or s.arch == "qwen2moe":
            out |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
        if oss:
            out |= {p + "attn_output.bias": (H,), p + "attn_sinks.weight": (s.n_heads,), p + "ffn_gate_inp.bias": (E,),
                    p + "ffn_gate_exps.bias": (E, F), p + "ffn_up_exps.bias": (E, F),
                    p + "ffn_down_exps.bias": (E, H)}  # fmt: skip
        if s.arch in ("olmoe", "minimax-m2"):
            out |= {p + "attn_q_norm.weight": (q,), p + "attn_k_norm.weight": (kv,)}
        if s.arch == "minimax-m2":
            out[p + "exp_probs_b.bias"] = (E,)
        if s.arch == "qwen2moe":
            Fs = s.shared_ffn
            out |= {p + "ffn_gate_inp_shexp.weight": (1, H), p + "ffn_gate_shexp.weight": (Fs, H),
                    p + "ffn_up_shexp.weight": (Fs, H), p + "ffn_down_shexp.weight": (H, Fs)}  # fmt: skip
    return out


@pytest.mark.parametrize("name", REAL + TINY)
def test_tensor_table_is_llama_cpps(name):
    s = replace(SHAPES[name], n_layers=2)  # specs only: nothing is written
    specs = s.tensors(T.Q8_0, T.Q8_0, 1000, 0)
    assert len({t.name for t in specs}) == len(specs)
    assert {t.name: t.shape for t in specs} == _table(s, 1000)
    for t in specs:
        kept = len(t.shape) == 1 or "ffn_gate_inp" in t.name or t.name.endswith(".bias")
        expert = t.name.endswith("_exps.weight")
        want = T.F32 if kept else T.MXFP4 if expert and s.arch == "gpt-oss" else T.Q8_0
        assert t.ggml_type == want, t.name


def test_real_dimensions_keys_and_sizes():
    md = SHAPES["gpt-oss-20b"].metadata("x", 38, 1000)
    a = "gpt-oss."
    assert (md[a + "block_count"], md[a + "expert_count"], md[a + "expert_used_count"]) == (24, 32, 4)
    assert (md[a + "attention.head_count"], md[a + "attention.head_count_kv"], md[a + "attention.key_length"]) == (
        64, 8, 64)  # fmt: skip
    assert (md[a + "attention.sliding_window"], md[a + "rope.scaling.factor"], md[a + "rope.freq_base"]) == (
        128, 32.0, 150000.0)  # fmt: skip
    assert md[a + "rope.scaling.original_context_length"] == 4096 and md[a + "expert_feed_forward_length"] == 2880
    assert SHAPES["gpt-oss-120b"].metadata("x", 38, 1000)[a + "expert_count"] == 128
    md = SHAPES["mixtral-8x7b"].metadata("x", 15, 1000)
    assert (md["llama.feed_forward_length"], md["llama.vocab_size"], md["llama.rope.dimension_count"]) == (
        14336, 1000, 128)  # fmt: skip
    assert "llama.attention.key_length" not in md  # Mixtral's config.json has no head_dim
    md = SHAPES["qwen2-57b-a14b"].metadata("x", 15, 1000)
    assert (md["qwen2moe.expert_feed_forward_length"], md["qwen2moe.expert_shared_feed_forward_length"]) == (
        2560, 20480)  # fmt: skip
    # the published gpt-oss files less their 201088-token vocabulary (embedding and head, Q8_0: 1.23 GB):
    # gpt-oss-20b-mxfp4.gguf 12.1 GB, gpt-oss-120b-mxfp4 63.4 GB; unsloth's 20b Q4_K_M 11.6 GB less
    # its Q5_0 embedding and Q8_0 head (1.0 GB)
    for name, quant, lo, hi in [("gpt-oss-20b", "MXFP4", 10.7, 11.0), ("gpt-oss-120b", "MXFP4", 61.8, 62.5),
                                ("gpt-oss-20b", "Q4_K_M", 10.4, 10.8), ("gpt-oss-20b", "Q8_0", 10.7, 11)]:  # fmt: skip
        assert lo < synth_nbytes(name, quant) / 1e9 < hi, (name, quant)
    # experts dominate: 46.7B of Mixtral's parameters at ~4.5-6.6 bits, 6.9B of OLMoE's
    assert 25 < synth_nbytes("mixtral-8x7b", "Q4_0") / 1e9 < 27
    assert 3.5 < synth_nbytes("olmoe-1b-7b", "Q4_0") / 1e9 < 4.0
    md = SHAPES["minimax-m2"].metadata("x", 15, 1000)
    a = "minimax-m2."
    assert (md[a + "block_count"], md[a + "expert_count"], md[a + "expert_used_count"]) == (62, 256, 8)
    assert (md[a + "attention.head_count"], md[a + "attention.head_count_kv"], md[a + "attention.key_length"]) == (
        48, 8, 128)  # fmt: skip
    assert (md[a + "rope.dimension_count"], md[a + "expert_gating_func"], md[a + "rope.freq_base"]) == (64, 2, 5e6)
    # MiniMax-M2's 227B parameters less its 200K-token vocabulary (224.6B of them in experts) at Q4_K_M's
    # 4.5 bits a weight (Q4_K), more on the use_more_bits layers' ffn_down (Q6_K)
    assert 4.5 < synth_nbytes("minimax-m2", "Q4_K_M") * 8 / 227.3e9 < 5.0


def test_q4_k_m_and_mxfp4_mixes_are_llama_quantizes():
    def types(name: str, quant: T, k_m: bool, layers: int | None = None) -> dict[str, T]:
        s = SHAPES[name] if layers is None else replace(SHAPES[name], n_layers=layers)
        return {t.name: t.ggml_type for t in s.tensors(quant, quant, 1000, 0, k_m=k_m)}

    oss = types("gpt-oss-20b", T.Q4_K, True)  # rows of 2880: every K-quant falls back
    assert {oss[f"blk.{i}.ffn_{w}_exps.weight"] for i in range(24) for w in ("gate", "up", "down")} == {T.MXFP4}
    assert oss["output.weight"] == T.Q8_0 and oss["token_embd.weight"] == T.Q5_0
    assert oss["blk.5.attn_q.weight"] == T.Q5_0 and oss["blk.5.attn_output.weight"] == T.Q4_K  # rows of 4096
    assert [i for i in range(24) if oss[f"blk.{i}.attn_v.weight"] == T.Q8_0] == [
        i for i in range(24) if use_more_bits(i, 24)]  # fmt: skip
    assert oss["blk.5.attn_sinks.weight"] == T.F32 and oss["blk.5.ffn_gate_exps.bias"] == T.F32
    mx = types("mixtral-8x7b", T.Q4_K, True)  # 8 experts: llama.cpp's Mixtral rules
    assert (mx["blk.3.attn_v.weight"], mx["blk.3.attn_k.weight"], mx["blk.3.attn_output.weight"]) == (
        T.Q8_0, T.Q8_0, T.Q5_K)  # fmt: skip
    assert mx["blk.3.attn_q.weight"] == T.Q4_K and mx["output.weight"] == T.Q6_K
    assert [i for i in range(32) if mx[f"blk.{i}.ffn_down_exps.weight"] == T.Q6_K] == [
        i for i in range(32) if use_more_bits(i, 32)]  # fmt: skip
    qw = types("qwen2-57b-a14b", T.Q4_K, True)
    assert (qw["blk.0.ffn_down_shexp.weight"], qw["blk.4.ffn_down_shexp.weight"]) == (T.Q6_K, T.Q4_K)
    assert (qw["blk.0.attn_v.weight"], qw["blk.4.attn_v.weight"], qw["blk.4.attn_k.weight"]) == (T.Q6_K, T.Q4_K, T.Q4_K)
    assert qw["blk.4.ffn_gate_inp_shexp.weight"] == T.F32 and qw["blk.4.attn_q.bias"] == T.F32
    mxfp4 = types("mixtral-8x7b", T.MXFP4, False, layers=2)  # MXFP4_MOE: 3-D experts MXFP4, the rest Q8_0
    assert mxfp4["blk.1.ffn_down_exps.weight"] == T.MXFP4 and mxfp4["blk.1.attn_k.weight"] == T.Q8_0
    assert mxfp4["output.weight"] == T.Q8_0 and mxfp4["token_embd.weight"] == T.Q8_0
    fl = types("tiny-gpt-oss", T.F16, False)  # a float file: the bf16 checkpoint's experts stay floats
    assert fl["blk.0.ffn_up_exps.weight"] == T.F16


@pytest.mark.parametrize("std", [1 / np.sqrt(2880), 0.002, 0.05])
def test_random_mxfp4_blocks_have_the_intended_std(std):
    raw = np.concatenate(list(random_blocks(T.MXFP4, 32 * 20000, std, 1)))
    w = dequantize(raw, T.MXFP4)  # gguf's own decoder
    assert abs(w.std() / std - 1) < 0.03 and abs(w.mean()) < 0.01 * std
    assert len(np.unique(raw.reshape(-1, 17)[:, 0])) == 2  # two neighbouring exponents


def test_gpt_oss_files_carry_harmony():
    md = harmony_tokenizer_metadata()
    tokens = md["tokenizer.ggml.tokens"]
    assert tokens[-len(HARMONY_TOKENS) :] == list(HARMONY_TOKENS)
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == "<|return|>"
    assert len(tokens) == len(build_tiny_bpe_metadata()["tokenizer.ggml.tokens"]) + len(HARMONY_TOKENS)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("quant", ["F32", "Q4_K_M", "MXFP4"])
def test_tiny_files_parse_with_the_table(tmp_path, name, quant):
    path = write_synth(name, quant, tmp_path / "m.gguf", progress=False)
    s, vocab = SHAPES[name], _vocab(SHAPES[name])
    f = GGUFFile(path)
    try:
        assert {n: t.shape for n, t in f.tensors.items()} == _table(s, vocab)
        assert sum(t.nbytes for t in f.tensors.values()) == synth_nbytes(name, quant)
        assert f.metadata["general.architecture"] == s.arch
    finally:
        f.close()
    by_name = {t.name: tuple(reversed(t.shape.tolist())) for t in GGUFReader(path).tensors}
    assert by_name == _table(s, vocab)


def _hf_twin(name: str, vocab: int):
    """A transformers model of the tiny shape's dims, and the test converter (tests/hf_gguf_*) that writes it."""
    from tests.hf_gguf_gpt_oss import GPT_OSS
    from tests.hf_gguf_gqa import MIXTRAL, OLMOE, QWEN2MOE
    from tests.hf_gguf_minimax import MINIMAX_M2

    s = SHAPES[name]
    common = dict(vocab_size=vocab, hidden_size=s.hidden, num_hidden_layers=s.n_layers, num_experts_per_tok=s.top_k,
                  num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads, rms_norm_eps=s.rms_eps)  # fmt: skip
    if s.arch == "gpt-oss":
        return GPT_OSS, GPT_OSS.hf_model(**common, intermediate_size=s.expert_ffn, num_local_experts=s.n_experts)
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta}}
    if s.arch == "llama":
        dims = dict(intermediate_size=s.expert_ffn, num_local_experts=s.n_experts, head_dim=None)
        return MIXTRAL, MIXTRAL.hf_model(**common, **dims, **rope)
    if s.arch == "olmoe":
        return OLMOE, OLMOE.hf_model(**common, intermediate_size=s.expert_ffn, num_experts=s.n_experts, **rope)
    if s.arch == "minimax-m2":
        rope["rope_parameters"]["partial_rotary_factor"] = s.rot_dim / s.head_dim
        dims = dict(intermediate_size=s.expert_ffn, num_local_experts=s.n_experts, head_dim=s.head_dim)
        return MINIMAX_M2, MINIMAX_M2.hf_model(**common, **dims, **rope, max_position_embeddings=s.context_length)
    dims = dict(intermediate_size=s.dense_ffn, moe_intermediate_size=s.expert_ffn, num_experts=s.n_experts,
                shared_expert_intermediate_size=s.shared_ffn)  # fmt: skip
    return QWEN2MOE, QWEN2MOE.hf_model(**common, **dims, **rope)


@pytest.mark.parametrize("name", TINY)
def test_keys_and_tensors_equal_the_converters_for_the_same_config(tmp_path, name):
    """tests/hf_gguf_gpt_oss.py and hf_gguf_gqa.py mirror the converter's GptOssModel, LlamaModel, OlmoeModel
    and Qwen2MoeModel: a transformers model of the same dims written by them has synth's tensor table and
    every one of synth's keys, with the same values and types."""
    pytest.importorskip("transformers")
    vocab = _vocab(SHAPES[name])
    arch, model = _hf_twin(name, vocab)
    ref, ours = tmp_path / "hf.gguf", write_synth(name, "F32", tmp_path / "synth.gguf", progress=False)
    arch.write(model, ref, tokenizer_md={})
    r, o = GGUFReader(ref), GGUFReader(ours)
    assert {t.name: t.shape.tolist() for t in o.tensors} == {t.name: t.shape.tolist() for t in r.tensors}
    skip = {"general.name", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    keys = {k for k in r.fields if k not in skip and not k.startswith("tokenizer.")}
    assert keys == {k for k in o.fields if k not in skip and not k.startswith("tokenizer.")}
    for k in keys:
        assert r.fields[k].types == o.fields[k].types, k
        assert np.allclose(r.fields[k].parts[-1], o.fields[k].parts[-1]), k


def _engine(path: str, n_slots: int = 64) -> Engine:
    return Engine(path, EngineOptions(n_slots=n_slots, threads=1))


@pytest.mark.parametrize("name", TINY)
def test_engine_runs_them_the_same_under_a_streaming_budget(tmp_path, name):
    path = write_synth(name, "Q8_0", tmp_path / "m.gguf", progress=False)  # gpt-oss: MXFP4 experts
    s = SHAPES[name]
    eng = _engine(path)
    try:
        assert eng.model.arch == s.arch and (eng.cfg.n_layers, eng.cfg.n_experts) == (s.n_layers, s.n_experts)
        full = eng.generate(PROMPT, 8, Sampler()).tokens
    finally:
        eng.close()
    assert len(set(full)) > 2  # no collapse onto one token
    eng = _engine(path, n_slots=s.top_k + 1)  # most experts are read from disk
    try:
        assert eng.generate(PROMPT, 8, Sampler()).tokens == full
        assert eng.cache.stats.misses > s.n_layers * s.top_k
    finally:
        eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("quant", ["F32", "F16"])
def test_llama_cpp_computes_the_same_model(tmp_path, monkeypatch, name, quant):
    """The independent check that synth's files are real files of the arch: llama.cpp's own graph on the
    same float file gives the same logits within float tolerance and the same greedy text."""
    llama_cpp = plain_llama_cpp(monkeypatch)
    path = str(write_synth(name, quant, tmp_path / "m.gguf", progress=False))
    eng = _engine(path)
    try:
        with torch.inference_mode():
            ours = eng.forward(PROMPT, 0, all_logits=True)
    finally:
        eng.close()
    ref, theirs = _llama_run(llama_cpp, path, PROMPT, 12)
    assert rel_error(ours, ref) < 2e-3  # llama.cpp rounds some activations to F16
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    eng = _engine(path)
    try:
        tok = eng.tokenizer
        ours_greedy = eng.generate(PROMPT, 12, Sampler()).tokens
    finally:
        eng.close()
    assert ours_greedy == theirs
    assert tok.decode(ours_greedy) == tok.decode(theirs)


@pytest.mark.parametrize("quant", ["Q4_K_M", "MXFP4"])
def test_llama_cpp_reads_the_mxfp4_experts(tmp_path, monkeypatch, quant):
    """A quantized gpt-oss file (MXFP4 experts): llama.cpp multiplies against 8-bit activations (~1%)."""
    llama_cpp = plain_llama_cpp(monkeypatch)
    path = str(write_synth("tiny-gpt-oss", quant, tmp_path / "m.gguf", progress=False))
    eng = _engine(path)
    try:
        with torch.inference_mode():
            ours = eng.forward(PROMPT, 0, all_logits=True)
    finally:
        eng.close()
    ref, _ = _llama_run(llama_cpp, path, PROMPT)
    assert rel_error(ours, ref) < 2e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_full_width_gpt_oss_layer_runs(tmp_path):
    """One real-width gpt-oss-20b block in Q4_K_M: MXFP4 experts, 2880-wide rows on their Q5_0/Q8_0 fallbacks."""
    path = write_synth("gpt-oss-20b", "Q4_K_M", tmp_path / "oss.gguf", layers=1, progress=False)
    try:
        f = GGUFFile(path)
        got = {n: f.tensors[n].ggml_type for n in ("blk.0.ffn_down_exps.weight", "blk.0.attn_v.weight",
                                                    "blk.0.attn_q.weight", "output.weight")}  # fmt: skip
        f.close()
        assert got == {"blk.0.ffn_down_exps.weight": T.MXFP4, "blk.0.attn_v.weight": T.Q8_0,
                       "blk.0.attn_q.weight": T.Q5_0, "output.weight": T.Q8_0}  # fmt: skip
        eng = _engine(path)
        try:
            assert (eng.cfg.n_experts, eng.cfg.top_k, eng.cfg.sliding_window, eng.cfg.hidden) == (32, 4, 128, 2880)
            assert len(eng.generate(list(range(20, 30)), 3, Sampler()).tokens) == 3
        finally:
            eng.close()
    finally:
        os.remove(path)


def test_cli_writes_a_shape_and_refuses_mxfp4_elsewhere(tmp_path):
    out = tmp_path / "o.gguf"
    run = [sys.executable, "-m", "moestream", "synth", "--shape", "tiny-olmoe", "--quant", "MXFP4", "-o", str(out)]
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    f = GGUFFile(str(out))
    assert f.tensors["blk.0.ffn_up_exps.weight"].ggml_type == T.MXFP4 and f.metadata["general.file_type"] == 38
    f.close()
    run[5] = "tiny"
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 2 and "MXFP4 is offered for the shapes gpt-oss-20b" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_compact_harmony_template_writes_harmonys_messages():
    """synth's gpt-oss template writes the turns, calls and results as gpt-oss's real template does (the
    system message is shorter, the tools' types plainer), and takes reasoning_effort."""
    from moestream.formats.chat_template import render_chat
    from moestream.serving.chat_formats import HARMONY, chat_format
    from tests.test_harmony import TOOL_CALL, TOOL_RESULT, TOOL_TURN, TOOLS

    tmpl = harmony_tokenizer_metadata()["tokenizer.chat_template"]
    assert chat_format(tmpl) is HARMONY
    out = render_chat(tmpl, TOOL_TURN, tools=TOOLS, reasoning_effort="low")
    assert out.startswith("<|start|>system<|message|>Reasoning: low\n\n# Valid channels: analysis, commentary, final.")
    # the tools' parameters as JSON, where the real template writes TypeScript types
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions" in out
    assert "// Current weather\ntype get_weather = (_: {" in out
    assert out.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        + TOOL_CALL + TOOL_RESULT + "<|start|>assistant"
    )  # fmt: skip
