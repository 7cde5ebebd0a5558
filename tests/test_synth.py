"""Synthetic models: real layouts, valid random blocks with the intended weight scale, fast to write."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import GGUFValueType as V
from gguf.quants import dequantize

from moestream.formats.gguf_file import GGUFFile
from moestream.formats.gguf_write import TensorSpec, array_tensor, write_gguf
from moestream.synth import shapes as synth
from moestream.synth.shapes import SHAPES, random_blocks, synth_nbytes, write_synth
from tests.test_synth_deepseek import plain_llama_cpp


def _expected_shapes(s: synth.SynthShape, vocab: int) -> dict[str, tuple[int, ...]]:
    H, q, kv, E, F = s.hidden, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_experts, s.expert_ffn
    out = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "output.weight": (vocab, H)}
    for i in range(s.n_layers):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": (H,),
            p + "attn_q.weight": (q, H),
            p + "attn_k.weight": (kv, H),
            p + "attn_v.weight": (kv, H),
            p + "attn_output.weight": (H, q),
            p + "attn_q_norm.weight": (s.head_dim,),
            p + "attn_k_norm.weight": (s.head_dim,),
            p + "ffn_norm.weight": (H,),
            p + "ffn_gate_inp.weight": (E, H),
            p + "ffn_gate_exps.weight": (E, F, H),
            p + "ffn_up_exps.weight": (E, F, H),
            p + "ffn_down_exps.weight": (E, H, F),
        }
        if s.shared_ffn:
            Fs = s.shared_ffn
            out |= {
                p + "ffn_gate_shexp.weight": (Fs, H),
                p + "ffn_up_shexp.weight": (Fs, H),
                p + "ffn_down_shexp.weight": (H, Fs),
            }
    return out


@pytest.mark.parametrize("quant", ["Q4_0", "Q8_0", "Q4_K", "F16"])
def test_tiny_writes_fast_and_loads(tmp_path, quant):
    t0 = time.perf_counter()
    path = write_synth("tiny", quant, tmp_path / "tiny.gguf", progress=False)
    assert time.perf_counter() - t0 < 10
    s = SHAPES["tiny"]
    f = GGUFFile(path)
    vocab = len(f.metadata["tokenizer.ggml.tokens"])
    expected = _expected_shapes(s, vocab)
    assert {n: t.shape for n, t in f.tensors.items()} == expected
    qt = T[quant]
    for name, info in f.tensors.items():
        if len(info.shape) == 1 or "ffn_gate_inp" in name:
            assert info.ggml_type == T.F32, name
        else:
            assert info.ggml_type == qt, name
    md = f.metadata
    assert md["general.architecture"] == "qwen3moe"
    assert md["qwen3moe.block_count"] == s.n_layers
    assert md["qwen3moe.expert_count"] == s.n_experts
    assert md["qwen3moe.expert_used_count"] == s.top_k
    assert md["qwen3moe.expert_feed_forward_length"] == s.expert_ffn
    assert md["qwen3moe.attention.key_length"] == s.head_dim
    assert "qwen3moe.expert_shared_feed_forward_length" not in md
    assert "tokenizer.chat_template" in md
    data = sum(t.nbytes for t in f.tensors.values())
    assert data == synth_nbytes("tiny", quant)
    # each expert is one contiguous slice of nbytes / E
    assert f.tensors["blk.0.ffn_down_exps.weight"].nbytes % s.n_experts == 0
    f.close()


def test_gguf_reader_decodes_a_synth_file(tmp_path):
    path = write_synth("tiny", "Q4_K", tmp_path / "t.gguf", layers=1, progress=False)
    r = GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    emb = dequantize(by_name["token_embd.weight"].data, T.Q4_K)
    down = dequantize(by_name["blk.0.ffn_down_exps.weight"].data, T.Q4_K)
    router = np.asarray(by_name["blk.0.ffn_gate_inp.weight"].data)
    assert np.all(np.isfinite(emb)) and np.all(np.isfinite(down))
    assert np.std(emb) == pytest.approx(1.0, rel=0.05)
    assert np.std(down) == pytest.approx(0.002, rel=0.05)
    assert np.std(router) == pytest.approx(2 / np.sqrt(SHAPES["tiny"].hidden), rel=0.05)


@pytest.mark.parametrize("quant", [T.Q4_0, T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32])
@pytest.mark.parametrize("std", [1.0, 0.002])
def test_random_blocks_have_the_intended_std(quant, std):
    n = 1 << 18
    raw = np.concatenate([np.asarray(c).reshape(-1).view(np.uint8) for c in random_blocks(quant, n, std, 7)])
    w = np.asarray(dequantize(raw, quant), dtype=np.float32).reshape(-1)
    assert w.size == n
    assert np.all(np.isfinite(w))
    assert np.std(w) == pytest.approx(std, rel=0.03)
    assert abs(np.mean(w)) < 0.02 * std  # zero-mean: no shared direction for the residual to drift along
    # different blocks really differ (not one block repeated)
    assert len(np.unique(raw[: 64 * 1024])) > 200


def test_use_more_bits_is_llama_cpps_rule():
    # llama.cpp's Q4_K_M ffn_down layers for 40 layers: 0-4, 35-39 and every third from 7
    assert [i for i in range(40) if synth.use_more_bits(i, 40)] == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31,
                                                                   34, 35, 36, 37, 38, 39]  # fmt: skip


def _check_q4_k_m_types(specs, n_layers: int) -> None:
    for t in specs:
        if t.ggml_type == T.F32:
            continue
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1
        six = t.name == "output.weight" or ("ffn_down" in t.name and synth.use_more_bits(layer, n_layers))
        assert t.ggml_type == (T.Q6_K if six else T.Q5_K if "attn_qkv" in t.name else T.Q4_K), t.name
    downs = [t.ggml_type for t in specs if "ffn_down_exps" in t.name]
    assert T.Q6_K in downs and T.Q4_K in downs


def test_q4_k_m_uses_llama_cpps_exception_types(tmp_path):
    path = write_synth("tiny", "Q4_K_M", tmp_path / "m.gguf", progress=False)
    f = GGUFFile(path)
    assert f.metadata["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    _check_q4_k_m_types([TensorSpec(n, i.ggml_type, i.shape, None) for n, i in f.tensors.items()], 4)
    assert sum(t.nbytes for t in f.tensors.values()) == synth_nbytes("tiny", "Q4_K_M")
    f.close()
    # qwen35moe's DeltaNet input projection (attn_qkv) is Q5_K in a Q4_K_M file (specs only: nothing written)
    s = replace(SHAPES["qwen3.6-35b-a3b"], n_layers=8)
    vocab = len(synth.build_tiny_bpe_metadata()["tokenizer.ggml.tokens"])
    specs = synth.synth_tensors(s, T.Q4_K, T.Q4_K, vocab, 0, k_m=True)
    _check_q4_k_m_types(specs, 8)
    assert sum(t.ggml_type == T.Q5_K for t in specs) == 6  # the 6 DeltaNet layers of 8


def test_random_blocks_are_seeded():
    a = b"".join(bytes(c) for c in random_blocks(T.Q4_0, 4096, 0.1, (1, 2)))
    b = b"".join(bytes(c) for c in random_blocks(T.Q4_0, 4096, 0.1, (1, 2)))
    c = b"".join(bytes(c) for c in random_blocks(T.Q4_0, 4096, 0.1, (1, 3)))
    assert a == b and a != c


def test_fewer_layers_keep_the_same_weights(tmp_path):
    full = GGUFFile(write_synth("tiny", "Q4_0", tmp_path / "full.gguf", progress=False))
    two = GGUFFile(write_synth("tiny", "Q4_0", tmp_path / "two.gguf", layers=2, progress=False))
    assert two.metadata["qwen3moe.block_count"] == 2
    assert "blk.2.attn_q.weight" not in two.tensors
    for name in ("blk.1.ffn_up_exps.weight", "blk.0.attn_q.weight", "output.weight"):
        assert np.array_equal(full.read(name), two.read(name))
    other = GGUFFile(write_synth("tiny", "Q4_0", tmp_path / "s1.gguf", layers=1, seed=1, progress=False))
    assert not np.array_equal(other.read("blk.0.ffn_up_exps.weight"), full.read("blk.0.ffn_up_exps.weight"))


def test_shared_expert_tensors(tmp_path, monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-shared", replace(SHAPES["tiny"], shared_ffn=512, n_layers=2))
    f = GGUFFile(write_synth("tiny-shared", "Q8_0", tmp_path / "sh.gguf", progress=False))
    s = SHAPES["tiny-shared"]
    assert {n: t.shape for n, t in f.tensors.items()} == _expected_shapes(s, len(f.metadata["tokenizer.ggml.tokens"]))
    assert f.metadata["qwen3moe.expert_shared_feed_forward_length"] == 512
    assert f.tensors["blk.1.ffn_down_shexp.weight"].ggml_type == T.Q8_0


def test_dense_type_override(tmp_path):
    f = GGUFFile(write_synth("tiny", "Q4_K", tmp_path / "d.gguf", layers=1, dense="F16", progress=False))
    assert f.tensors["blk.0.attn_q.weight"].ggml_type == T.F16
    assert f.tensors["token_embd.weight"].ggml_type == T.F16
    assert f.tensors["blk.0.ffn_gate_exps.weight"].ggml_type == T.Q4_K


def test_real_shapes_are_consistent():
    for name, s in SHAPES.items():
        if not isinstance(s, synth.SynthShape):
            continue  # deepseek2 and glm4moe shapes: tests/test_synth_deepseek.py
        assert s.top_k < s.n_experts, name
        for dim in (s.hidden, s.expert_ffn, s.n_heads * s.head_dim, s.shared_ffn):
            assert dim % 256 == 0, (name, dim)  # every supported type (Q4_K: 256) fits the rows
    # Qwen3-30B-A3B: ~17 GB at Q4_0, as llama.cpp's file of that shape (measured 17.3 GB with the full vocab)
    assert 16e9 < synth_nbytes("qwen3-30b-a3b", "Q4_0") < 17.5e9


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown shape"):
        write_synth("nope", "Q4_0", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="unknown quant"):
        write_synth("tiny", "Q3_K", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="layers"):
        write_synth("tiny", "Q4_0", tmp_path / "x.gguf", layers=99)
    with pytest.raises(ValueError, match="layers must be between 4 and 61"):  # V3's 3 dense blocks and a MoE one
        write_synth("deepseek-v3", "Q4_0", tmp_path / "x.gguf", layers=3)
    assert not list(tmp_path.iterdir())


def test_metadata_types_are_what_llama_cpp_expects(tmp_path):
    r = GGUFReader(write_synth("tiny", "Q4_0", tmp_path / "t.gguf", layers=1, progress=False))
    types = {k: f.types for k, f in r.fields.items()}
    assert types["qwen3moe.block_count"] == [V.UINT32]
    assert types["qwen3moe.expert_count"] == [V.UINT32]
    assert types["general.file_type"] == [V.UINT32]
    assert types["qwen3moe.rope.freq_base"] == [V.FLOAT32]
    assert types["qwen3moe.attention.layer_norm_rms_epsilon"] == [V.FLOAT32]
    assert types["tokenizer.ggml.tokens"] == [V.ARRAY, V.STRING]
    assert types["tokenizer.ggml.token_type"] == [V.ARRAY, V.INT32]
    assert types["tokenizer.ggml.eos_token_id"] == [V.UINT32]
    assert types["tokenizer.ggml.add_bos_token"] == [V.BOOL]
    assert types["general.architecture"] == [V.STRING]


def test_writer_checks_producers_and_leaves_no_partial_file(tmp_path):
    short = TensorSpec("x", T.F32, (64,), lambda: [np.zeros(63, np.float32)])
    with pytest.raises(ValueError, match="expected 256"):
        write_gguf(tmp_path / "x.gguf", "qwen3moe", {}, [short], progress=False)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_writer_layout_with_odd_sizes(tmp_path, where):
    """Odd-sized tensors land at aligned offsets wherever page boundaries fall (O_DIRECT or buffered)."""
    if where == "shm" and not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs")
    d = tmp_path if where == "tmp" else tempfile.mkdtemp(dir="/dev/shm")
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate([1, 7, 3000, 1 << 20, 5])}
    path = os.path.join(d, "odd.gguf")
    size = write_gguf(
        path,
        "test",
        {"a.str": "x" * 4093},
        [array_tensor(k, T.F32, a.shape, a) for k, a in arrays.items()],
        progress=False,
    )
    f = GGUFFile(path)
    assert size == f.file_size
    for k, a in arrays.items():
        assert f.tensors[k].offset % 32 == 0
        assert np.array_equal(f.read(k).view(np.float32), a)
    assert f.metadata["a.str"] == "x" * 4093
    f.close()
    if where == "shm":
        shutil.rmtree(d)


def _expected_qwen35_shapes(s: synth.SynthShape, vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor shapes llama.cpp's qwen35moe loader asks for (numpy order: [rows, cols])."""
    H, E, F, Fs, D = s.hidden, s.n_experts, s.expert_ffn, s.shared_ffn, s.head_dim
    d, Hk, Hv = s.lin_head_dim, s.lin_k_heads, s.lin_v_heads
    conv = 2 * Hk * d + Hv * d
    out = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "output.weight": (vocab, H)}
    for i in range(s.n_layers):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": (H,),
            p + "post_attention_norm.weight": (H,),
            p + "ffn_gate_inp.weight": (E, H),
            p + "ffn_gate_inp_shexp.weight": (1, H),
            p + "ffn_gate_exps.weight": (E, F, H),
            p + "ffn_up_exps.weight": (E, F, H),
            p + "ffn_down_exps.weight": (E, H, F),
            p + "ffn_gate_shexp.weight": (Fs, H),
            p + "ffn_up_shexp.weight": (Fs, H),
            p + "ffn_down_shexp.weight": (H, Fs),
        }
        if (i + 1) % 4:  # Gated DeltaNet
            out |= {
                p + "attn_qkv.weight": (conv, H),
                p + "attn_gate.weight": (Hv * d, H),
                p + "ssm_beta.weight": (Hv, H),
                p + "ssm_alpha.weight": (Hv, H),
                p + "ssm_conv1d.weight": (conv, s.conv_kernel),
                p + "ssm_dt.bias": (Hv,),
                p + "ssm_a": (Hv,),
                p + "ssm_norm.weight": (d,),
                p + "ssm_out.weight": (H, Hv * d),
            }
        else:  # gated attention: attn_q holds the query and its output gate
            out |= {
                p + "attn_q.weight": (2 * s.n_heads * D, H),
                p + "attn_k.weight": (s.n_kv_heads * D, H),
                p + "attn_v.weight": (s.n_kv_heads * D, H),
                p + "attn_output.weight": (H, s.n_heads * D),
                p + "attn_q_norm.weight": (D,),
                p + "attn_k_norm.weight": (D,),
            }
    return out


def test_qwen36_shape_is_the_real_architecture():
    s = SHAPES["qwen3.6-35b-a3b"]
    vocab = len(synth.build_tiny_bpe_metadata()["tokenizer.ggml.tokens"])
    specs = synth.synth_tensors(replace(s, n_layers=8), T.Q4_K, T.Q4_K, vocab, 0)  # specs only: nothing written
    assert {t.name: t.shape for t in specs} == _expected_qwen35_shapes(replace(s, n_layers=8), vocab)
    for t in specs:
        small = len(t.shape) == 1 or "ffn_gate_inp" in t.name or "ssm_conv1d" in t.name
        assert t.ggml_type == (T.F32 if small else T.Q4_K), t.name
    md = synth.shape_metadata(s, "x", 15)
    a = "qwen35moe."
    assert md["general.architecture"] == "qwen35moe"
    assert (md[a + "ssm.group_count"], md[a + "ssm.time_step_rank"], md[a + "ssm.state_size"]) == (16, 32, 128)
    assert (md[a + "ssm.inner_size"], md[a + "ssm.conv_kernel"], md[a + "rope.dimension_count"]) == (4096, 4, 64)
    assert md[a + "attention.recurrent_layers"] == [(i + 1) % 4 != 0 for i in range(40)]
    assert a + "feed_forward_length" not in md
    # ~19 GB at 4-bit experts (the real Q4_K_M is 22 GB: a 248k vocabulary and some 6-bit tensors)
    assert 18.5e9 < synth_nbytes("qwen3.6-35b-a3b", "Q4_K") < 20e9


def test_qwen36_layers_load_and_generate(tmp_path):
    """Four full-size layers (three DeltaNet, one attention) load and decode into distinct tokens."""
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from moestream.engine.sampling import Sampler

    path = write_synth("qwen3.6-35b-a3b", "Q4_0", tmp_path / "q36.gguf", layers=4, progress=False)
    threads = torch.get_num_threads()
    try:
        # one thread: steadier on a busy 2-core machine
        eng = Engine(path, EngineOptions(n_slots=64, ubatch=4, threads=1))
        try:
            assert eng.model.arch == "qwen35moe" and eng.cfg.recurrent == [True, True, True, False]
            assert (eng.cfg.n_v_heads, eng.cfg.v_head_dim, eng.cfg.rot_dim) == (32, 128, 64)
            prompt = [20, 21, 22, 23, 24, 25, 26, 27, 28]
            gen = eng.generate(prompt, 4, Sampler())
            assert len(gen.tokens) == 4 and len(set(gen.tokens)) > 1  # no collapse onto one token
            again = eng.generate(prompt + gen.tokens + [7], 2, Sampler())
            assert again.stats.reused_tokens == len(prompt) + 3
        finally:
            eng.close()
    finally:
        torch.set_num_threads(threads)
        os.remove(path)  # 1.9 GB: pytest keeps the last runs' temporary directories


def test_qwen36_architecture_reads_the_same_in_llama_cpp(tmp_path, monkeypatch):
    """The benchmark runs llama.cpp on these files: it must compute the same model from them.

    The architecture at a small width (a full-width file is 1.9 GB for four layers).
    """
    llama_cpp = plain_llama_cpp(monkeypatch)
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    small = replace(
        SHAPES["qwen3.6-35b-a3b"], hidden=256, n_heads=4, head_dim=64, n_experts=16, top_k=4, expert_ffn=256,
        shared_ffn=256, lin_k_heads=2, lin_v_heads=4, lin_head_dim=64, rot_dim=16,
    )  # fmt: skip
    monkeypatch.setitem(SHAPES, "qwen3.6-small", small)
    path = str(write_synth("qwen3.6-small", "Q8_0", tmp_path / "s.gguf", layers=4, progress=False))
    prompt = list(range(20, 40))
    threads = torch.get_num_threads()
    eng = Engine(path, EngineOptions(n_slots=64, threads=1))
    try:
        with torch.inference_mode():
            ours = eng.forward(prompt, 0, all_logits=True)
    finally:
        eng.close()
        torch.set_num_threads(threads)
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(prompt)
    ref = torch.tensor(llm.scores[: len(prompt)])
    llm.close()
    assert float((ours - ref).norm() / ref.norm()) < 2e-2  # bf16 here, 8-bit activations there (measured 5e-3)
