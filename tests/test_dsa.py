"""DeepSeek Sparse Attention (GLM-5 `glm-dsa`, DeepSeek-V3.2 `deepseek32`): what tests/test_models.py does
not already hold of it. A decode step at a context past the index top-k attends to top_k keys; long prompts
(in spans, micro-batched, streamed, batched) give transformers' logits and greedy tokens there; the
selection does matter (the dense reference differs); GLM's shared blocks; the file's indexer keys and
their refusals; and (slow) llama.cpp's own converter writes the keys and tensors tests/hf_gguf_dsa.py does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from moestream.compute import kernels
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import ComputeError, ModelFileError
from moestream.models.deepseek32 import DeepSeek32
from moestream.models.glm_dsa import GlmDsa, GlmDsaConfig
from moestream.models.loader import tensor_shapes
from moestream.models.sparse_attention import index_scores
from tests.hf_gguf import one_torch_thread, random_tokens, rewrite_gguf
from tests.hf_gguf_dsa import DEEPSEEK_V32, GLM_DSA, INDEX_TOP_K, reference_cut_gaps
from tests.llama_cpp_converter import converter_source
from tests.test_batch import Stepper

transformers = pytest.importorskip("transformers")
one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)

N_LONG = 150  # a prompt of several micro-batches, each past the index top-k (32)


@pytest.fixture(scope="module", params=[GLM_DSA, pytest.param(DEEPSEEK_V32, marks=pytest.mark.slow)],
                ids=["glm-5", "deepseek-v3.2"])  # fmt: skip
def tiny(request, tmp_path_factory):
    """(arch, file, tokens, transformers' logits at every position, model)."""
    arch = request.param
    model = arch.hf_model(seed=5)
    path = str(tmp_path_factory.mktemp(arch.id) / "m.gguf")
    arch.write(model, path)
    toks = random_tokens(N_LONG + 8, model.config.vocab_size, seed=5)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float()
    return arch, path, toks, ref, model


def _greedy_hf(model, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(model(torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]


def test_a_decode_step_attends_to_top_k_keys(tiny):
    """Past the index top-k a decode step's attention sees top_k keys in every block, however long the
    context; before it, every position."""
    _, path, toks, _, _ = tiny
    eng = Engine(path, EngineOptions(n_slots=64, exact=True))
    try:
        with torch.inference_mode():
            eng.forward(toks[:20], 0)
            eng.forward([toks[20]], 20)
            assert eng.kv.keys_attended == [21] * eng.cfg.n_blocks
            eng.forward(toks[21:N_LONG], 21)
            for pos in (N_LONG, N_LONG + 1):
                eng.forward([toks[pos]], pos)
                assert eng.kv.keys_attended == [INDEX_TOP_K] * eng.cfg.n_blocks
    finally:
        eng.close()


@pytest.mark.parametrize("ubatch", [16, 64])
def test_long_prompt_in_micro_batches_matches_transformers(tiny, ubatch):
    """A prompt of several micro-batches (spans of 16 or 64 queries, most past the top-k) and decode steps
    after it: the logits within 1e-3 of transformers' in exact mode at every position whose choice is not a
    near-tie in the reference itself (reference_cut_gaps: its top-k cut within 2e-3 of the next score in a
    full block, which float32 rope tables can settle either way); those are a few in a hundred."""
    _, path, toks, ref, model = tiny
    clear = reference_cut_gaps(model, toks) > 2e-3
    assert clear[INDEX_TOP_K:].float().mean() > 0.8
    eng = Engine(path, EngineOptions(n_slots=64, exact=True, ubatch=ubatch))
    try:
        with torch.inference_mode():
            got = [eng.forward(toks[a : min(a + ubatch, N_LONG)], a, all_logits=True) for a in range(0, N_LONG, ubatch)]
            err = (torch.cat(got) - ref[:N_LONG]).abs().amax(-1)
            assert err[clear[:N_LONG]].max() < 1e-3
            for j in range(N_LONG, N_LONG + 8):
                if clear[j]:
                    assert (eng.forward([toks[j]], j) - ref[j]).abs().max() < 1e-3, j
                else:
                    eng.forward([toks[j]], j)
    finally:
        eng.close()


def test_prompt_queries_past_the_top_k_read_their_choice_alone(tiny, monkeypatch):
    """A prompt's queries attend to their own top_k rows in one C call (none more, none past the query), and
    give the logits of the masked attention over every earlier key to float32 rounding."""
    from moestream.models import sparse_attention

    _, path, toks, _, _ = tiny
    counts, real = [], kernels.mla_sparse

    def spy(*args):
        counts.append(args[5].clone())
        return real(*args)

    def prompt_logits() -> torch.Tensor:
        eng = Engine(path, EngineOptions(n_slots=64, exact=True, ubatch=64))
        try:
            with torch.inference_mode():
                return torch.cat([eng.forward(toks[a : a + 64], a, all_logits=True) for a in range(0, N_LONG, 64)])
        finally:
            eng.close()

    if not kernels.available():
        pytest.skip("no native kernels on this machine")
    monkeypatch.setattr(kernels, "mla_sparse", spy)
    sparse = prompt_logits()
    seen = torch.cat(counts)
    assert len(seen) and int(seen.max()) == INDEX_TOP_K and int(seen.min()) >= 1
    monkeypatch.setattr(sparse_attention, "NATIVE_DTYPES", ())  # the masked form over every key
    assert torch.allclose(sparse, prompt_logits(), atol=1e-4)


def test_the_choice_matters(tiny):
    """The dense reference (the same model attending to every key) differs from the sparse one past the top-k
    by far more than the tolerance the tests hold moestream to; before it, not at all."""
    _, _, toks, ref, model = tiny
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = 10_000
    try:
        with torch.no_grad():
            dense = model(torch.tensor([toks[:80]])).logits[0].float()
    finally:
        for m in model.modules():
            if hasattr(m, "index_topk"):
                m.index_topk = INDEX_TOP_K
    assert (dense[:INDEX_TOP_K] - ref[:INDEX_TOP_K]).abs().max() < 1e-4
    assert (dense[INDEX_TOP_K:80] - ref[INDEX_TOP_K:80]).abs().max() > 0.1


def test_greedy_equals_transformers_alone_streamed_and_batched(tiny):
    """Greedy tokens past the top-k: transformers', with every expert cached, under a budget that streams
    most of them, and decoded in a batch beside another sequence."""
    _, path, toks, _, model = tiny
    prompt, n = toks[:60], 8
    want = _greedy_hf(model, prompt, n)
    cfg = model.config
    for slots in (cfg.num_hidden_layers * cfg.n_routed_experts, cfg.num_experts_per_tok + 1):
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=16))
        try:
            assert eng.generate(prompt, n, Sampler()).tokens == want, slots
        finally:
            eng.close()
    eng = Engine(path, EngineOptions(n_slots=64, ubatch=16))
    try:
        stepper = Stepper(eng.model, eng.cache)
        other = random_tokens(45, cfg.vocab_size, seed=9)
        kvs = [eng.model.new_kv(128), eng.model.new_kv(128)]
        with torch.inference_mode():
            last = [stepper.forward(prompt, kvs[0], 0), stepper.forward(other, kvs[1], 0)]
            got = []
            for j in range(n):
                got.append(int(last[0].argmax()))
                out = stepper.forward_batch([got[-1], int(last[1].argmax())], kvs, [60 + j, 45 + j])
                last = [out[0], out[1]]
        assert got == want
        assert kvs[0].keys_attended == [INDEX_TOP_K] * eng.cfg.n_blocks
    finally:
        eng.close()


def test_glm_shared_blocks_reuse_the_full_blocks_choice(tiny):
    arch, path, *_ = tiny
    if arch is not GLM_DSA:
        pytest.skip("DeepSeek-V3.2 has an indexer in every block")
    eng = Engine(path, EngineOptions(n_slots=64))
    try:
        assert eng.cfg.indexer.full == (True, False, True) and eng.cfg.indexer.interleaved
        assert [m.mixer.full for m in eng.model.layers] == [True, False, True]
        assert not hasattr(eng.model.layers[1].mixer, "index_q")  # a shared block holds no indexer weights
        assert eng.kv.index_keys[1] is None and eng.kv.index_keys[0] is not None
    finally:
        eng.close()


def test_index_scores_are_the_references_formula():
    """score(t, s) = sum_h w[t, h] relu(scale q[t, h] . k[s]), -inf past each query; in pieces of queries as
    in one call."""
    g = torch.Generator().manual_seed(0)
    T, H, D, S, pos = 9, 4, 16, 30, 21
    q, k, w = torch.randn(T, H, D, generator=g), torch.randn(S, D, generator=g), torch.randn(T, H, generator=g)
    got = index_scores(q, k, w, pos, 0.25)
    want = torch.einsum("th,ths->ts", w, torch.relu(torch.einsum("thd,sd->ths", q, k) * 0.25))
    visible = torch.arange(S)[None] <= torch.arange(pos, pos + T)[:, None]
    assert torch.isinf(got[~visible]).all() and (got[~visible] < 0).all()
    assert torch.allclose(got[visible], want[visible], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("H", "D", "S"), [(32, 128, 1027), (5, 18, 9), (8, 64, 3)])
def test_a_decode_steps_native_index_scores_are_the_formula(dtype, H, D, S):
    """One query over every stored key (a decode step), read in the cache's dtype by the native kernel: the
    formula to float32 rounding, whatever the head and key counts (tiles of four and their remainders)."""
    if not kernels.available():
        pytest.skip("no native kernels on this machine")
    g = torch.Generator().manual_seed(1)
    q, w = torch.randn(1, H, D, generator=g), torch.randn(1, H, generator=g)
    k = torch.randn(S, D, generator=g).to(dtype)
    got = index_scores(q, k, w, S - 1, D**-0.5)
    want = torch.einsum("h,hs->s", w[0], torch.relu(torch.einsum("hd,sd->hs", q[0], k.float()) * D**-0.5))
    assert got.shape == (1, S) and torch.allclose(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "k", "levels"), [(16384, 2048, None), (300, 32, 5), (40, 40, None), (7, 1, 2)])
def test_a_decode_steps_choice_is_torch_topk_in_position_order(n, k, levels):
    """The native top-k: the set torch.topk picks, as ascending positions; among equal scores at the cut (few
    distinct levels here) the first positions; a NaN score refused."""
    if not kernels.available():
        pytest.skip("no native kernels on this machine")
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) if levels is None else torch.randint(0, levels, (n,), generator=g).float()
    got = kernels.topk_positions(x, k)
    assert got.tolist() == sorted(got.tolist()) and len(set(got.tolist())) == k
    if levels is None:
        assert got.tolist() == sorted(x.topk(k).indices.tolist())
    else:
        cut = x.sort(descending=True).values[k - 1]
        above = (x > cut).nonzero()[:, 0].tolist()
        ties = (x == cut).nonzero()[:, 0].tolist()[: k - len(above)]
        assert got.tolist() == sorted(above + ties)
    x[n // 2] = float("nan")
    with pytest.raises(ComputeError):
        kernels.topk_positions(x, k)


def test_chosen_rows_read_in_place_equal_the_gathered_rows():
    """The decode kernel reading the indexer's rows where they lie in the cache gives the bits it gives on
    those rows gathered, and the torch form to float32 rounding."""
    if not kernels.available():
        pytest.skip("no native kernels on this machine")
    g = torch.Generator().manual_seed(2)
    H, nope, R, L, V, S = 8, 32, 16, 64, 32, 300
    k_b, v_b = torch.randn(H, L, nope, generator=g).bfloat16(), torch.randn(H, V, L, generator=g).bfloat16()
    qn, qp = torch.randn(1, H, nope, generator=g), torch.randn(1, H, R, generator=g)
    lat, kpe = torch.randn(S, L, generator=g).bfloat16(), torch.randn(S, R, generator=g).bfloat16()
    rows = torch.randperm(S, generator=g)[:77].sort().values
    in_place = kernels.mla_decode(qn, qp, k_b, v_b, lat, kpe, V, 0.125, rows)
    assert torch.equal(in_place, kernels.mla_decode(qn, qp, k_b, v_b, lat[rows], kpe[rows], V, 0.125))
    q_lat = torch.einsum("hn,hln->hl", qn[0], k_b.float())
    scores = (q_lat @ lat[rows].float().T + qp[0] @ kpe[rows].float().T) * 0.125
    want = torch.einsum("hl,hvl->hv", torch.softmax(scores, -1) @ lat[rows].float(), v_b.float())
    assert torch.allclose(in_place[0], want, rtol=1e-4, atol=1e-4)


def test_the_portable_build_reads_the_chosen_rows_and_scores_keys_alike():
    """The scalar C build (CPUs without AVX-512) against this CPU's: the indexer's scores and the decode step
    over chosen rows, equal to float32 rounding."""
    if not kernels.available():
        pytest.skip("no native kernels on this machine")
    from moestream.compute import native

    g = torch.Generator().manual_seed(3)
    H, D, S = 8, 48, 37
    q, w, keys = torch.randn(H, D, generator=g), torch.randn(H, generator=g), torch.randn(S, D, generator=g).half()
    Hm, nope, R, L, V = 6, 16, 16, 32, 16
    k_b, v_b = torch.randn(Hm, L, nope, generator=g).bfloat16(), torch.randn(Hm, V, L, generator=g).bfloat16()
    qn, qp = torch.randn(Hm, nope, generator=g), torch.randn(Hm, R, generator=g)
    lat, kpe = torch.randn(S, L, generator=g).bfloat16(), torch.randn(S, R, generator=g).bfloat16()
    rows = torch.tensor([0, 3, 4, 9, 20, 21, 36])
    outs = []
    for lib in (native.lib(), native.lib(("-DMS_SCALAR",))):
        scores, attn = torch.empty(S), torch.empty(Hm, V)
        lib.ms_index_scores(q.data_ptr(), w.data_ptr(), H, D, keys.data_ptr(), 2, S, 0.5, scores.data_ptr())
        lib.ms_mla_decode(qn.data_ptr(), qp.data_ptr(), k_b.data_ptr(), v_b.data_ptr(), 1, lat.data_ptr(),
                          kpe.data_ptr(), 1, rows.data_ptr(), S, len(rows), Hm, L, R, nope, V, 0.25,
                          attn.data_ptr())  # fmt: skip
        outs.append((scores, attn))
    assert torch.allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


def test_indexer_types_and_the_glm_5_2_default(tmp_path):
    """The file's attention.indexer.types, and without it llama.cpp's rule: every block full below a 1M
    context, GLM-5.2's pattern (full, full, then one in four) from there."""
    model = GLM_DSA.hf_model(num_hidden_layers=7)
    path = tmp_path / "m.gguf"
    GLM_DSA.write(model, path)
    from moestream.formats.gguf_file import GGUFFile

    f = GGUFFile(path)
    try:
        md, shapes = dict(f.metadata), tensor_shapes(f)
    finally:
        f.close()
    assert GlmDsaConfig.from_metadata(md, shapes).indexer.full == (True,) * 7
    md.pop("glm-dsa.attention.indexer.types")
    assert GlmDsaConfig.from_metadata(md, shapes).indexer.full == (True,) * 7
    md["glm-dsa.context_length"] = 1 << 20
    assert GlmDsaConfig.from_metadata(md, shapes).indexer.full == (True, True, True, False, False, False, True)


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("attention.indexer.types", [False, True, True], "first block a shared one"),
        ("attention.indexer.key_length", 16, "fewer than the 32 rotary dims"),
        ("attention.indexer.top_k", None, "is missing"),
        ("attention.indexer.head_count", "eight", "not a number"),
    ],
)
def test_bad_indexer_keys_are_refused_in_one_line(tmp_path, key, value, words):
    model = GLM_DSA.hf_model()
    good, bad = tmp_path / "good.gguf", tmp_path / "bad.gguf"
    GLM_DSA.write(model, good)
    rewrite_gguf(good, bad, {f"glm-dsa.{key}": value})
    with pytest.raises(ModelFileError, match=words) as err:
        Engine(str(bad), EngineOptions(n_slots=8)).close()
    assert "\n" not in str(err.value) and key in str(err.value)


def test_skipped_mtp_blocks_are_said():
    cfg = DeepSeek32.Config
    assert cfg.__name__ == "DeepSeek32Config"
    note = DeepSeek32.load_notes(type("C", (), {"nextn": 1})())
    assert note and "multi-token-prediction" in note[0] and "skipped" in note[0]
    assert GlmDsa.load_notes(type("C", (), {"nextn": 0})()) == []


# ---- llama.cpp's own converter -------------------------------------------------------------------------

# The converter runs as it is, but for the tokenizer, which the comparison leaves out: the tiny BPE vocabulary
# has neither a pre-tokenizer hash the converter knows nor GLM's special tokens, and transformers 5 does not
# set add_bos_token from tokenizer_config.json beside a tokenizer.json (DeepSeek-V3.2's converter asserts it).
CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import transformers
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
load = transformers.AutoTokenizer.from_pretrained
def with_bos(*args, **kwargs):
    tok = load(*args, **kwargs)
    tok.add_bos_token = True
    return tok
transformers.AutoTokenizer.from_pretrained = with_bos
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32"]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", [GLM_DSA, DEEPSEEK_V32], ids=["glm-5", "deepseek-v3.2"])
def test_the_real_converter_writes_what_hf_gguf_dsa_writes(tmp_path, arch):
    """convert_hf_to_gguf.py from the llama-cpp-python sdist on a saved tiny checkpoint: the same tensors
    (names, shapes, values) and the same keys (values and types) as tests/hf_gguf_dsa.py's file, tokenizer
    keys aside. Its quirks: DeepSeek-V3.2's asserts add_bos_token in tokenizer_config.json, and llama.cpp
    needs config.json's scoring_func (which transformers does not write) to read its router."""
    from tests.hf_checkpoint import write_tokenizer

    src = converter_source()
    if src is None:
        pytest.skip("the llama-cpp-python sdist (its converter) could not be had: no network and no LLAMA_CPP_SRC")
    model = arch.hf_model(seed=1)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    write_tokenizer(str(ckpt))
    if arch is DEEPSEEK_V32:
        conf = json.loads((ckpt / "tokenizer_config.json").read_text()) | {"add_bos_token": True}
        (ckpt / "tokenizer_config.json").write_text(json.dumps(conf))
        conf = json.loads((ckpt / "config.json").read_text()) | {"scoring_func": "sigmoid"}
        (ckpt / "config.json").write_text(json.dumps(conf))
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    run = subprocess.run([sys.executable, "-c", CONVERT, str(src), str(ckpt), str(theirs)], capture_output=True,
                         text=True, env=dict(os.environ, NO_LOCAL_GGUF="1"), timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    arch.write(model, ours)
    r, o = GGUFReader(theirs), GGUFReader(ours)
    r_tensors = {t.name: t for t in r.tensors}
    assert {t.name: t.shape.tolist() for t in o.tensors} == {n: t.shape.tolist() for n, t in r_tensors.items()}
    for t in o.tensors:
        assert r_tensors[t.name].tensor_type == t.tensor_type, t.name
        np.testing.assert_array_equal(np.asarray(r_tensors[t.name].data), np.asarray(t.data), err_msg=t.name)
    skip = {"general.name", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.file_type"}
    mine = {k for k in o.fields if k not in skip and not k.startswith("tokenizer.")}
    theirs_keys = {k for k in r.fields if not k.startswith(("tokenizer.", "general.")) and k not in skip}
    assert {k for k in mine if not k.startswith("general.")} == theirs_keys
    for k in theirs_keys:
        assert r.fields[k].types == o.fields[k].types, k
        assert np.allclose(r.fields[k].parts[-1], o.fields[k].parts[-1]), k


# ---- synth shapes ----------------------------------------------------------------------------------------


def test_synth_tiny_glm_dsa_runs_the_same_streamed(tmp_path):
    from moestream.synth.shapes import write_synth

    path = write_synth("tiny-glm-dsa", "Q8_0", tmp_path / "m.gguf", progress=False)
    prompt = list(range(20, 60))
    eng = Engine(path, EngineOptions(n_slots=64, threads=1))
    try:
        assert eng.cfg.indexer.full == (True, True, False, True)
        full = eng.generate(prompt, 8, Sampler()).tokens
        assert eng.kv.keys_attended == [16] * 4
    finally:
        eng.close()
    assert len(set(full)) > 2
    eng = Engine(path, EngineOptions(n_slots=6, threads=1))
    try:
        assert eng.generate(prompt, 8, Sampler()).tokens == full
    finally:
        eng.close()


@pytest.mark.parametrize("name,cls,blocks,heads", [("glm-5", GlmDsaConfig, 78, 32), ("deepseek-v3.2", None, 61, 64)])
def test_synth_real_shapes_and_their_slices_read_as_the_models(name, cls, blocks, heads):
    """glm-5 and deepseek-v3.2 at their real sizes (and a 6-block --layers slice): the config read from the
    keys and tensor table synth writes (without writing the file)."""
    from gguf import GGMLQuantizationType as Q

    from moestream.models.deepseek32 import DeepSeek32Config
    from moestream.synth.shapes import _resolve

    cls = cls or DeepSeek32Config
    for layers, n in ((None, blocks), (6, 6)):
        s = _resolve(name, layers)
        shapes = {t.name: t.shape for t in s.tensors(Q.Q4_K, Q.Q4_K, 1000, 0, k_m=True)}
        cfg = cls.from_metadata(s.metadata(name, 15, 1000), shapes)
        assert cfg.n_blocks == n and cfg.first_moe_block == 3 and cfg.n_experts == 256
        assert (cfg.indexer.heads, cfg.indexer.head_dim, cfg.indexer.top_k) == (heads, 128, 2048)
        assert cfg.indexer.full == (True,) * n and cfg.indexer.interleaved == (name == "glm-5")


# ---- GLM-5's chat format ---------------------------------------------------------------------------------

GLM5_TEMPLATE = (Path(__file__).parent / "templates" / "glm-4.7-flash.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}  # fmt: skip


def test_glm5_format_opens_thinking_and_splits_reasoning_content_and_calls():
    """GLM-5's format (GLM-4.7's template): the generation prompt opens <think>, so the answer starts inside
    it; calls are written without newlines; streamed in any pieces it splits as whole; and the reasoning of
    the turns after the last user message goes back into the prompt (interleaved thinking)."""
    from moestream.formats.chat_template import render_chat
    from moestream.serving.chat_formats import GLM, OutputParser, chat_format, split_answer, starts_thinking
    from moestream.serving.text import split_pieces

    assert chat_format(GLM5_TEMPLATE) is GLM
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call]},
            {"role": "tool", "content": "22C"}]  # fmt: skip
    prompt = render_chat(GLM5_TEMPLATE, msgs, tools=[WEATHER], add_generation_prompt=True)
    assert prompt.endswith("<|assistant|><think>") and starts_thinking(GLM, prompt)
    assert "<think>Look it up.</think>" in prompt  # the tool turn's reasoning is kept
    assert "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>" in prompt
    text = ("It is sunny.</think>Here:<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")  # fmt: skip
    want = ("It is sunny.", "Here:", [("get_weather", {"city": "Paris", "days": 2})])

    def run(chunks: list[str]) -> tuple:
        p = OutputParser(GLM, use_tools=True, thinking=True, tools=[WEATHER])
        r, c, calls = split_pieces([x for ch in chunks for x in p.feed(ch)] + p.finish())
        return r, c, [(x.name, json.loads(x.arguments)) for x in calls]

    r, c, calls = split_answer(OutputParser(GLM, use_tools=True, thinking=True, tools=[WEATHER]), text)
    assert (r, c, [(x.name, json.loads(x.arguments)) for x in calls]) == want
    assert all(run([text[:i], text[i:]]) == want for i in range(len(text)))
