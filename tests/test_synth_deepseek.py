"""Synthetic deepseek2 (DeepSeek-V2-Lite/V3, Kimi-K2) and glm4moe (GLM-4.5-Air/4.6) models: the tensor table
and keys llama.cpp's converter writes, the Q4_K_M mix llama-quantize picks, real sizes, and the engine and
llama.cpp computing the same model from them."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from moestream.compute import native
from moestream.engine.engine import Engine
from moestream.engine.model_file import dense_estimate, open_model, trunk_blocks
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.formats.gguf_file import GGUFFile
from moestream.models import ARCHITECTURES
from moestream.synth import shapes as synth
from moestream.synth.arches import DeepSeekShape, GlmShape
from moestream.synth.shapes import SHAPES, synth_nbytes, write_synth
from tests.hf_gguf import one_torch_thread, rel_error

VOCAB = len(synth.build_tiny_bpe_metadata()["tokenizer.ggml.tokens"])
one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def _deepseek_table(s: DeepSeekShape, vocab: int) -> dict[str, tuple[int, ...]]:
    """The shapes llama.cpp's deepseek2 loader asks for (numpy order), MLA split form, no MTP block."""
    H, nh, L, R, nope, v = s.hidden, s.n_heads, s.kv_lora, s.qk_rope, s.qk_nope, s.v_head_dim
    E, F, Fs = s.n_experts, s.expert_ffn, s.n_shared * s.expert_ffn
    out = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "output.weight": (vocab, H)}
    for i in range(s.n_layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": (H,), p + "attn_kv_a_mqa.weight": (L + R, H), p + "attn_kv_a_norm.weight": (L,),
                p + "attn_k_b.weight": (nh, L, nope), p + "attn_v_b.weight": (nh, v, L),
                p + "attn_output.weight": (H, nh * v), p + "ffn_norm.weight": (H,)}  # fmt: skip
        if s.q_lora:
            out |= {p + "attn_q_a.weight": (s.q_lora, H), p + "attn_q_a_norm.weight": (s.q_lora,),
                    p + "attn_q_b.weight": (nh * (nope + R), s.q_lora)}  # fmt: skip
        else:
            out[p + "attn_q.weight"] = (nh * (nope + R), H)
        if s.indexed(i):  # glm-dsa / deepseek32: the indexer (llama.cpp's INDEXER_* tensors)
            D, nx = s.index_dim, s.index_heads
            x = p + "indexer."
            out |= {x + "k_norm.weight": (D,), x + "k_norm.bias": (D,), x + "proj.weight": (nx, H),
                    x + "attn_k.weight": (D, H), x + "attn_q_b.weight": (nx * D, s.q_lora)}  # fmt: skip
        if i < s.n_dense:
            out |= {p + "ffn_gate.weight": (s.dense_ffn, H), p + "ffn_up.weight": (s.dense_ffn, H),
                    p + "ffn_down.weight": (H, s.dense_ffn)}  # fmt: skip
            continue
        out |= {p + "ffn_gate_inp.weight": (E, H), p + "ffn_gate_exps.weight": (E, F, H),
                p + "ffn_up_exps.weight": (E, F, H), p + "ffn_down_exps.weight": (E, H, F),
                p + "ffn_gate_shexp.weight": (Fs, H), p + "ffn_up_shexp.weight": (Fs, H),
                p + "ffn_down_shexp.weight": (H, Fs)}  # fmt: skip
        if s.gating == 2:
            out[p + "exp_probs_b.bias"] = (E,)
    return out


def _glm_table(s: GlmShape, vocab: int) -> dict[str, tuple[int, ...]]:
    """The shapes llama.cpp's glm4moe loader asks for, the nextn block's included (its optional parts too)."""
    H, D, E, F = s.hidden, s.head_dim, s.n_experts, s.expert_ffn
    q, kv = s.n_heads * D, s.n_kv_heads * D
    out = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "output.weight": (vocab, H)}
    for i in range(s.n_layers + 1):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": (H,), p + "attn_q.weight": (q, H), p + "attn_q.bias": (q,),
                p + "attn_k.weight": (kv, H), p + "attn_k.bias": (kv,), p + "attn_v.weight": (kv, H),
                p + "attn_v.bias": (kv,), p + "attn_output.weight": (H, q)}  # fmt: skip
        out[p + "post_attention_norm.weight"] = (H,)
        if s.qk_norm:
            out |= {p + "attn_q_norm.weight": (D,), p + "attn_k_norm.weight": (D,)}
        if i < s.n_dense:
            out |= {p + "ffn_gate.weight": (s.dense_ffn, H), p + "ffn_up.weight": (s.dense_ffn, H),
                    p + "ffn_down.weight": (H, s.dense_ffn)}  # fmt: skip
        else:
            out |= {p + "ffn_gate_inp.weight": (E, H), p + "exp_probs_b.bias": (E,),
                    p + "ffn_gate_exps.weight": (E, F, H), p + "ffn_up_exps.weight": (E, F, H),
                    p + "ffn_down_exps.weight": (E, H, F), p + "ffn_gate_shexp.weight": (s.n_shared * F, H),
                    p + "ffn_up_shexp.weight": (s.n_shared * F, H)}  # fmt: skip
            out[p + "ffn_down_shexp.weight"] = (H, s.n_shared * F)
        if i == s.n_layers:
            out |= {p + "nextn.eh_proj.weight": (H, 2 * H), p + "nextn.embed_tokens.weight": (vocab, H),
                    p + "nextn.enorm.weight": (H,), p + "nextn.hnorm.weight": (H,),
                    p + "nextn.shared_head_head.weight": (vocab, H)}  # fmt: skip
            out[p + "nextn.shared_head_norm.weight"] = (H,)
    return out


def _table(s, vocab: int) -> dict[str, tuple[int, ...]]:
    return _deepseek_table(s, vocab) if isinstance(s, DeepSeekShape) else _glm_table(s, vocab)


NEW_SHAPES = [n for n, s in SHAPES.items() if isinstance(s, (DeepSeekShape, GlmShape))]


@pytest.mark.parametrize("name", NEW_SHAPES)
def test_tensor_table_is_llama_cpps(name):
    s = SHAPES[name]
    s = replace(s, n_layers=min(s.n_layers, s.n_dense + 2))  # specs only: nothing is written
    specs = s.tensors(T.Q4_0, T.Q4_0, VOCAB, 0)
    assert len({t.name for t in specs}) == len(specs)
    assert {t.name: t.shape for t in specs} == _table(s, VOCAB)
    for t in specs:
        small = len(t.shape) == 1 or "ffn_gate_inp" in t.name or "indexer.proj" in t.name
        assert t.ggml_type == (T.F32 if small else T.Q4_0), t.name


def test_real_dimensions_and_keys():
    v2, v3, kimi = SHAPES["deepseek-v2-lite"], SHAPES["deepseek-v3"], SHAPES["kimi-k2"]
    md = v2.metadata("x", 15, VOCAB)
    a = "deepseek2."
    assert (md[a + "block_count"], md[a + "leading_dense_block_count"], md[a + "expert_count"]) == (27, 1, 64)
    assert (md[a + "expert_used_count"], md[a + "expert_shared_count"], md[a + "expert_gating_func"]) == (6, 2, 1)
    assert (md[a + "attention.key_length"], md[a + "attention.value_length"]) == (576, 512)
    assert (md[a + "attention.key_length_mla"], md[a + "attention.value_length_mla"]) == (192, 128)
    assert md[a + "attention.head_count_kv"] == 1 and md[a + "vocab_size"] == VOCAB
    assert a + "attention.q_lora_rank" not in md and a + "expert_weights_norm" not in md
    assert md[a + "rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)
    md = v3.metadata("x", 15, VOCAB)
    assert (md[a + "expert_group_count"], md[a + "expert_group_used_count"], md[a + "expert_gating_func"]) == (8, 4, 2)
    assert (md[a + "attention.q_lora_rank"], md[a + "expert_weights_scale"], md[a + "rope.scaling.factor"]) == (
        1536, 2.5, 40.0)  # fmt: skip
    assert md[a + "expert_weights_norm"] is True and md[a + "block_count"] == 61
    md = kimi.metadata("x", 15, VOCAB)
    assert (md[a + "expert_count"], md[a + "attention.head_count"], md[a + "expert_group_count"]) == (384, 64, 1)
    assert md[a + "expert_weights_scale"] == pytest.approx(2.827)
    g = "glm4moe."
    md = SHAPES["glm-4.5-air"].metadata("x", 15, VOCAB)
    assert (md[g + "block_count"], md[g + "nextn_predict_layers"], md[g + "rope.dimension_count"]) == (47, 1, 64)
    assert (md[g + "attention.head_count"], md[g + "attention.head_count_kv"], md[g + "expert_count"]) == (96, 8, 128)
    md = SHAPES["glm-4.6"].metadata("x", 15, VOCAB)
    assert (md[g + "block_count"], md[g + "leading_dense_block_count"], md[g + "expert_count"]) == (93, 3, 160)
    # Q4_K_M sizes of the real files (less their 100k-160k vocabularies): V2-Lite 10.4 GB, V3 404 GB,
    # Kimi-K2 621 GB, GLM-4.5-Air 72.9 GB, GLM-4.6 216 GB
    for name, lo, hi in [("deepseek-v2-lite", 9.5, 10.5), ("deepseek-v3", 395, 405), ("kimi-k2", 605, 621),
                         ("glm-4.5-air", 69, 73), ("glm-4.6", 210, 216)]:  # fmt: skip
        assert lo < synth_nbytes(name, "Q4_K_M") / 1e9 < hi, name


def test_q4_k_m_is_llama_quantizes_mix():
    s = SHAPES["deepseek-v2-lite"]  # 27 blocks; 1408-wide experts and a 10944-wide dense FFN: fallbacks
    types = {t.name: t.ggml_type for t in s.tensors(T.Q4_K, T.Q4_K, VOCAB, 0, k_m=True)}
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    assert types["blk.0.ffn_down.weight"] == T.Q8_0  # Q6_K wanted (first eighth), rows of 10944
    assert types["blk.0.ffn_gate.weight"] == T.Q4_K  # rows of 2048
    assert types["blk.1.ffn_down_exps.weight"] == T.Q8_0 and types["blk.4.ffn_down_exps.weight"] == T.Q5_0
    assert types["blk.5.ffn_down_exps.weight"] == T.Q8_0  # every third from n/8: (5 - 3) % 3 == 2
    assert types["blk.1.ffn_down_shexp.weight"] == T.Q6_K and types["blk.4.ffn_down_shexp.weight"] == T.Q4_K
    assert types["blk.4.attn_k_b.weight"] == T.Q5_0 and types["blk.4.attn_v_b.weight"] == T.Q4_K
    assert types["blk.4.attn_kv_a_mqa.weight"] == T.Q4_K and types["blk.4.ffn_gate_exps.weight"] == T.Q4_K
    assert types["blk.4.ffn_gate_inp.weight"] == T.F32
    glm = SHAPES["glm-4.6"]  # 93 blocks with the nextn one: attn_v and ffn_down more bits on the same rule
    types = {t.name: t.ggml_type for t in glm.tensors(T.Q4_K, T.Q4_K, VOCAB, 0, k_m=True)}
    more = [i for i in range(93) if types[f"blk.{i}.attn_v.weight"] == T.Q6_K]
    assert more == [i for i in range(93) if synth.use_more_bits(i, 93)]
    assert all(types[f"blk.{i}.ffn_down{'' if i < 3 else '_exps'}.weight"] == (T.Q6_K if i in more else T.Q4_K)
               for i in range(93))  # fmt: skip
    assert types["blk.5.attn_k.weight"] == T.Q4_K and types["blk.92.nextn.eh_proj.weight"] == T.Q4_K


@pytest.mark.parametrize("name", ["tiny-deepseek2", "tiny-deepseek3", "tiny-glm4moe"])
@pytest.mark.parametrize("quant", ["F32", "Q4_K_M", "Q8_0"])
def test_tiny_files_parse_with_the_table(tmp_path, name, quant):
    path = write_synth(name, quant, tmp_path / "m.gguf", progress=False)
    f = GGUFFile(path)
    try:
        assert {n: t.shape for n, t in f.tensors.items()} == _table(SHAPES[name], VOCAB)
        assert sum(t.nbytes for t in f.tensors.values()) == synth_nbytes(name, quant)
        assert f.metadata["general.architecture"] == SHAPES[name].arch
    finally:
        f.close()
    # gguf's own reader agrees (shapes in ggml order)
    by_name = {t.name: tuple(reversed(t.shape.tolist())) for t in GGUFReader(path).tensors}
    assert by_name == _table(SHAPES[name], VOCAB)


def test_keys_and_tensors_equal_the_converters_for_the_same_config(tmp_path):
    """tests/hf_gguf.py mirrors convert_hf_to_gguf.py's DeepseekV2Model: a transformers model of the same dims
    written by it has synth's tensor table and every one of synth's keys, with the same values and types."""
    pytest.importorskip("transformers")
    from tests.hf_gguf_deepseek import DEEPSEEK_V2_LITE, DEEPSEEK_V3, write_deepseek2_from_hf

    for arch, name in [(DEEPSEEK_V3, "tiny-deepseek3"), (DEEPSEEK_V2_LITE, "tiny-deepseek2")]:
        s = SHAPES[name]
        extra = {} if s.gating == 2 else {"n_group": 1, "topk_group": 1}  # V2-Lite's config.json sets both to 1
        dims = dict(num_hidden_layers=s.n_layers, n_routed_experts=s.n_experts, num_experts_per_tok=s.top_k,
                    moe_intermediate_size=s.expert_ffn, intermediate_size=s.dense_ffn)  # fmt: skip
        model = arch.hf_model(seed=0, max_position_embeddings=s.context_length, **dims, **extra)
        ref, ours = tmp_path / f"{name}-hf.gguf", write_synth(name, "F32", tmp_path / f"{name}.gguf", progress=False)
        write_deepseek2_from_hf(model, ref)  # kv_b split into k_b/v_b, as the converter writes it now
        r, o = GGUFReader(ref), GGUFReader(ours)
        assert {t.name: t.shape.tolist() for t in o.tensors} == {t.name: t.shape.tolist() for t in r.tensors}, name
        skip = {"general.name", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
        keys = {k for k in r.fields if k not in skip and not k.startswith("tokenizer.")}
        assert keys == {k for k in o.fields if k not in skip and not k.startswith("tokenizer.")}, name
        for k in keys:
            assert r.fields[k].types == o.fields[k].types, k
            assert np.allclose(r.fields[k].parts[-1], o.fields[k].parts[-1]), k


def _engine(path: str, n_slots: int = 64) -> Engine:
    return Engine(path, EngineOptions(n_slots=n_slots, threads=1))


@pytest.mark.parametrize("name", ["tiny-deepseek2", "tiny-deepseek3"])
def test_engine_runs_them_the_same_under_a_streaming_budget(tmp_path, name):
    path = write_synth(name, "Q8_0", tmp_path / "m.gguf", progress=False)
    prompt = list(range(20, 60))
    eng = _engine(path)
    try:
        assert eng.model.arch == "deepseek2" and eng.cfg.n_layers == SHAPES[name].n_layers - SHAPES[name].n_dense
        full = eng.generate(prompt, 8, Sampler()).tokens
    finally:
        eng.close()
    assert len(set(full)) > 2  # no collapse onto one token
    eng = _engine(path, n_slots=6)  # 6 of 32 or 208 experts: most are read from disk
    try:
        assert eng.generate(prompt, 8, Sampler()).tokens == full
        assert eng.cache.stats.misses > eng.cfg.n_layers * eng.cfg.n_experts
    finally:
        eng.close()


def _check_up_projections(attn) -> None:
    """A quantized file's up-projections are held at its bits where the lane kernels take them (else bf16), and
    the decode step over them equals the float formula on the same weights up to the int8 activations."""
    up, cfg = attn.up, attn.cfg
    if not native.lane_ok():
        assert up.k_b.dtype == torch.bfloat16 and up.v_b.dtype == torch.bfloat16
        return
    assert up.k_b is None and up.v_b is None and up.k_lane.ggml_type == T.Q5_0
    g = torch.Generator().manual_seed(5)
    S = 40
    q_nope = torch.randn(1, cfg.n_heads, cfg.qk_nope, generator=g)
    q_pe = torch.randn(1, cfg.n_heads, cfg.qk_rope, generator=g)
    lat = torch.randn(S, cfg.kv_lora_rank, generator=g).to(torch.float16)
    kpe = torch.randn(S, cfg.qk_rope, generator=g).to(torch.float16)
    rows = torch.tensor([0, 3, 7, 21, 39])
    k_b, v_b, lf, kf = up.k_dense(), up.v_dense(), lat.float()[rows], kpe.float()[rows]
    q_lat = torch.einsum("hn,hln->hl", q_nope[0], k_b)
    assert rel_error(up.absorb(q_nope)[0], q_lat) < 1e-2
    p = torch.softmax((q_lat @ lf.T + q_pe[0] @ kf.T) * cfg.kq_scale, dim=-1)
    want = torch.einsum("hl,hvl->hv", p @ lf, v_b)[None]
    got = attn.absorbed(q_nope, q_pe, lat, kpe, None, rows)
    assert got.shape == want.shape and rel_error(got, want) < 2e-2


def test_full_width_v2_lite_slice_runs(tmp_path):
    """Two real-width blocks (the dense one and a MoE one) in Q4_K_M: every fallback type on the way."""
    path = write_synth("deepseek-v2-lite", "Q4_K_M", tmp_path / "v2.gguf", layers=2, progress=False)
    try:
        f = GGUFFile(path)
        got = {f.tensors[n].ggml_type for n in ("blk.0.ffn_down.weight", "blk.1.ffn_down_exps.weight",
                                               "blk.1.attn_k_b.weight")}  # fmt: skip
        f.close()
        assert got == {T.Q8_0, T.Q5_0}
        eng = _engine(path)
        try:
            assert (eng.cfg.n_experts, eng.cfg.kv_lora_rank, eng.cfg.q_lora_rank, eng.cfg.top_k) == (64, 512, 0, 6)
            _check_up_projections(eng.model.layers[1].mixer)
            m = open_model(path)
            try:  # the plan counts them at what they take
                assert eng.model.dense_nbytes == dense_estimate(m.gguf, m.exact, trunk_blocks(m.cfg))
            finally:
                m.close()
            toks = eng.generate(list(range(20, 30)), 4, Sampler()).tokens
            assert len(toks) == 4
        finally:
            eng.close()
    finally:
        os.remove(path)


@pytest.mark.skipif("glm4moe" not in ARCHITECTURES, reason="the glm4moe model is not in this tree yet")
def test_engine_runs_glm(tmp_path):
    path = write_synth("tiny-glm4moe", "Q8_0", tmp_path / "g.gguf", progress=False)
    eng = _engine(path)
    try:
        assert eng.model.arch == "glm4moe"
        toks = eng.generate(list(range(20, 60)), 8, Sampler()).tokens
        assert len(set(toks)) > 2
    finally:
        eng.close()


# ---- llama.cpp reads the same models ----------------------------------------------------------------


def plain_llama_cpp(monkeypatch):
    """llama_cpp, with Llama() loading weights without its extra CPU buffer types (AMX, repacked layouts), as
    bench/llamacpp_run.py runs it: a native build here may use AMX, which this machine lists but a process is
    not allowed to run (SIGILL on the first quantized matmul)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (CI does not install it)")
    lib = llama_cpp.llama_cpp
    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(lib, "llama_model_default_params", params)  # Llama() reads it from this module
    return llama_cpp


def _llama_run(llama_cpp, path: str, prompt: list[int], n: int = 0) -> tuple[torch.Tensor, list[int]]:
    """llama.cpp's logits at every prompt position, and its n greedy tokens after the prompt."""
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, logits_all=True, verbose=False, n_threads=1)
    try:
        llm.eval(prompt)
        logits = torch.tensor(np.asarray(llm.scores[: len(prompt)]))
        out: list[int] = []
        for _ in range(n):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(out[-1:])
        return logits, out
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-deepseek2", "tiny-deepseek3"])
def test_llama_cpp_computes_the_same_model(tmp_path, monkeypatch, name):
    """The independent check that synth's files are real deepseek2 files: llama.cpp's own graph on the same
    F32 file gives the same logits within float tolerance and the same greedy text."""
    llama_cpp = plain_llama_cpp(monkeypatch)
    path = str(write_synth(name, "F32", tmp_path / "m.gguf", progress=False))
    prompt = list(range(20, 60))
    eng = _engine(path)
    try:
        with torch.inference_mode():
            ours = eng.forward(prompt, 0, all_logits=True)
    finally:
        eng.close()
    ref, theirs = _llama_run(llama_cpp, path, prompt, 12)
    assert rel_error(ours, ref) < 2e-3  # llama.cpp rounds some activations to F16
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    eng = _engine(path)
    try:
        tok = eng.tokenizer
        ours_greedy = eng.generate(prompt, 12, Sampler()).tokens
    finally:
        eng.close()
    assert ours_greedy == theirs
    assert tok.decode(ours_greedy) == tok.decode(theirs)


def test_llama_cpp_loads_the_glm_file(tmp_path, monkeypatch):
    """llama.cpp's glm4moe loader takes synth's tensor table and keys (nextn block included)."""
    llama_cpp = plain_llama_cpp(monkeypatch)
    path = str(write_synth("tiny-glm4moe", "F32", tmp_path / "g.gguf", progress=False))
    prompt = list(range(20, 60))
    ref, _ = _llama_run(llama_cpp, path, prompt)
    assert torch.isfinite(ref).all() and len(set(ref.argmax(-1).tolist())) > 2
    if "glm4moe" in ARCHITECTURES:  # once the model lands: the same logits
        eng = _engine(path)
        try:
            with torch.inference_mode():
                ours = eng.forward(prompt, 0, all_logits=True)
        finally:
            eng.close()
        assert rel_error(ours, ref) < 2e-3


@pytest.mark.parametrize("name", [n for n in NEW_SHAPES if isinstance(SHAPES[n], DeepSeekShape)])
def test_full_size_headers_load_in_the_deepseek2_config(name):
    """The real shapes' headers and tensor tables (not written) are accepted as they are, with the latent
    cache at 576 values a token a block for every full-size one (and the indexer's keys beside it)."""
    s = SHAPES[name]
    model = ARCHITECTURES[s.arch]
    shapes = {t.name: t.shape for t in s.tensors(T.Q4_K, T.Q4_K, VOCAB, 0, k_m=True)}
    cfg = model.Config.from_metadata(s.metadata("x", 15, VOCAB), shapes)
    assert (cfg.n_blocks, cfg.first_moe_block, cfg.n_layers) == (s.n_layers, s.n_dense, s.n_layers - s.n_dense)
    assert (cfg.n_experts, cfg.top_k, cfg.shared_ffn) == (s.n_experts, s.top_k, s.n_shared * s.expert_ffn)
    assert cfg.routing.n_group == s.n_group and cfg.routing.gating == ("sigmoid" if s.gating == 2 else "softmax")
    if not name.startswith("tiny"):
        index_keys = s.index_dim * sum(s.indexed(i) for i in range(s.n_layers))
        assert model.memory(cfg).kv_nbytes(1, exact=False) == (s.n_layers * 576 + index_keys) * 2
