"""DeepSeek-V4 (deepseek4): what the parametrized tests (test_models.py) do not reach with their 96 tokens:
a prompt past the 128-token windows of heavily compressed attention, the lightning indexer really dropping
entries, the clipped SwiGLU biting, hash-routed experts requested before any layer runs, the compressed
cache's bytes, the load notes and the skipped MTP block; and the real converter's output for the same model.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

import moestream.models.compressed_attention as ca
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.formats.gguf_file import GGUFFile
from moestream.models.deepseek4 import DeepSeek4
from moestream.models.loader import config_from_gguf
from moestream.models.moe import ClippedSwiGLU
from moestream.streaming.expert_cache import ExpertCache
from moestream.synth.shapes import synth_nbytes, write_synth
from tests.hf_gguf import one_torch_thread, random_tokens, rewrite_gguf
from tests.hf_gguf_deepseek4 import DEEPSEEK_V4, snap_experts_to_mxfp4, write_deepseek_checkpoint
from tests.llama_cpp_converter import converter_source
from tests.test_synth_deepseek import plain_llama_cpp

pytest.importorskip("transformers")

N_PROMPT, N_DECODE = 300, 6  # past two HCA windows of 128 and 75 CSA entries against a top-k of 4

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = DEEPSEEK_V4.hf_model()
    path = str(tmp_path_factory.mktemp("dsv4") / "m.gguf")
    DEEPSEEK_V4.write(model, path)
    toks = random_tokens(N_PROMPT + N_DECODE, model.config.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float()
    return model, path, toks, ref


def test_long_prompt_matches_transformers_at_every_position(tiny, monkeypatch):
    """Exact mode, a prompt of 300 (its attention in query chunks of 128 over the compressed cache), then
    decoding: every position within 1e-3 of transformers, and the same greedy tokens; on the way the
    indexer drops entries a query could see, and the clip bites."""
    model, path, toks, ref = tiny
    dropped, clipped = [], []
    choice, act = ca.indexer_choice, ClippedSwiGLU.act

    def spy_choice(q, keys, head_w, seen, topk, scale):
        picked = choice(q, keys, head_w, seen, topk, scale)
        dropped.append(int((seen & ~picked).sum()))
        return picked

    def spy_act(self, gate, up):
        clipped.append(int((gate > self.limit).sum() + (up.abs() > self.limit).sum()))
        return act(self, gate, up)

    monkeypatch.setattr(ca, "indexer_choice", spy_choice)
    monkeypatch.setattr(ClippedSwiGLU, "act", spy_act)
    eng = Engine(path, EngineOptions(n_slots=64, exact=True))
    try:
        with torch.inference_mode():
            ours = eng.forward(toks[:N_PROMPT], 0, all_logits=True)
            assert (ours - ref[:N_PROMPT]).abs().max() < 1e-3
            assert torch.equal(ours.argmax(-1), ref[:N_PROMPT].argmax(-1))
            for j in range(N_PROMPT, N_PROMPT + N_DECODE):
                last = eng.forward([toks[j]], j)
                assert (last - ref[j]).abs().max() < 1e-3, j
                assert int(last.argmax()) == int(ref[j].argmax())
    finally:
        eng.close()
    assert sum(dropped) > 0 and sum(clipped) > 0


def test_streaming_and_micro_batches_never_change_a_long_prompts_tokens(tmp_path):
    model = DEEPSEEK_V4.hf_model(seed=2)
    path = str(tmp_path / "q.gguf")
    DEEPSEEK_V4.write(model, path, dense_type=T.Q8_0, expert_type=T.Q4_0)
    prompt = random_tokens(N_PROMPT, model.config.vocab_size, seed=3)
    k, layers, experts = model.config.num_experts_per_tok, model.config.num_hidden_layers, model.config.n_routed_experts
    outputs, hits = [], []
    for slots, ubatch in ((k, 16), (k + 3, 64), (layers * experts, 512)):
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=ubatch))
        try:
            gen = eng.generate(prompt, 8, Sampler())
            outputs.append(gen.tokens)
            hits.append(gen.stats.hit_rate)
        finally:
            eng.close()
    assert outputs[0] == outputs[1] == outputs[2]
    assert hits[0] < hits[2]


def test_hash_layer_experts_are_requested_before_any_layer_runs(tiny, monkeypatch):
    """The hash layers' experts are a function of the token ids: the step asks the cache for them (prefetch)
    before the first layer's attention runs, for the prompt and for each decoded token."""
    model, path, toks, _ = tiny
    events: list[tuple] = []
    real_prefetch, real_core = ExpertCache.prefetch, ca.CompressedAttention.core

    def prefetch(self, layer, ids):
        events.append(("prefetch", layer, sorted(ids)))
        return real_prefetch(self, layer, ids)

    def core(self, parts, layer, cache, pos, rope):
        events.append(("compute", layer))
        return real_core(self, parts, layer, cache, pos, rope)

    monkeypatch.setattr(ExpertCache, "prefetch", prefetch)
    monkeypatch.setattr(ca.CompressedAttention, "core", core)
    n_hash = model.config.mlp_layer_types.count("hash_moe")
    tid2eid = [model.model.layers[i].mlp.gate.tid2eid for i in range(n_hash)]
    eng = Engine(path, EngineOptions(n_slots=64))
    try:
        prompt = toks[:40]
        gen = eng.generate(prompt, 3, Sampler())
        steps = [prompt, *[[t] for t in gen.tokens[:2]]]
    finally:
        eng.close()
    starts = [i for i, e in enumerate(events) if e == ("compute", 0)]
    assert len(starts) == len(steps)
    for s, tokens in zip(starts, steps, strict=True):
        asked = [e for e in events[max(0, s - n_hash) : s] if e[0] == "prefetch"]
        want = [
            ("prefetch", i, sorted(set(tid2eid[i][torch.tensor(tokens)].reshape(-1).tolist()))) for i in range(n_hash)
        ]
        assert asked == want


def test_a_decode_step_reads_hash_layers_ahead_without_waiting(tiny, monkeypatch):
    """In decode the hash layers' known experts are not waited for before the layers run: where the reader
    has buffers for reads ahead (the lookahead's, planned for a cache that misses), the first hash layer's
    reads start at once (the layer's fetch takes them), the next ones' when the layer before is fetched; the
    tokens are those of a cache that holds every expert."""
    model, path, toks, _ = tiny
    n_hash = model.config.mlp_layer_types.count("hash_moe")
    seen: list[tuple] = []
    real_prefetch = ExpertCache.prefetch

    def prefetch(self, layer, ids):
        n = real_prefetch(self, layer, ids)
        if self.phase == "decode":
            seen.append((layer, self.ahead.layer, sorted(self.ahead.known)))
        return n

    outputs, ahead = [], []
    for slots in (64, 12):  # every expert cached (no lookahead), then a small cache (its buffers planned)
        if slots == 12:
            monkeypatch.setattr(ExpertCache, "prefetch", prefetch)
        eng = Engine(path, EngineOptions(n_slots=slots))
        try:
            outputs.append(eng.generate(toks[:20], 4, Sampler()).tokens)
            ahead.append(eng.snapshot().ahead_reads)
        finally:
            eng.close()
    assert outputs[0] == outputs[1] and ahead[1] > 0
    assert seen and all(layer < n_hash for layer, _, _ in seen)
    for layer, first, known in seen:  # the first layer's reads under way, the later ones' waiting their turn
        assert first == 0 and known == list(range(1, layer + 1))


def test_compressed_cache_is_what_the_budget_counts_and_grows_by_the_entries(tiny):
    cfg = _cfg(tiny[1])
    mem = DeepSeek4.memory(cfg)
    csa, hca = cfg.ratios.count(4), cfg.ratios.count(128)
    # 512 more positions add 128 CSA entries (attention's and the indexer's) and 4 HCA entries, float32
    grow = mem.kv_nbytes(1024, False) - mem.kv_nbytes(512, False)
    assert grow == 4 * (csa * 128 * (cfg.head_dim + cfg.index_dim) + hca * 4 * cfg.head_dim)
    ctx = 1000
    kv = ca.CompressedKVCache(cfg.head_dim, cfg.window, ctx, torch.float16,
                              [cfg.attention(i).specs() for i in range(cfg.n_layers)])  # fmt: skip
    assert kv.nbytes == mem.kv_nbytes(ctx, False)


def test_the_budget_check_counts_the_hash_tables_as_indices(tiny):
    """The resident estimate (run's budget check) takes the I32 tid2eid tables as int64 indices, not weights."""
    from moestream.engine.model_file import dense_estimate
    from moestream.formats.gguf_model import GGUFModel

    f = GGUFModel(tiny[1])
    try:
        tables = [t for t in f.tensors.values() if t.ggml_type == 26]
        assert tables and dense_estimate(f, False) > sum(t.nbytes for t in tables)
    finally:
        f.close()


def _cfg(path: str):
    f = GGUFFile(path)
    try:
        return config_from_gguf(DeepSeek4, f)
    finally:
        f.close()


def test_load_notes_name_the_schedule_the_kv_bytes_and_the_skipped_mtp(tiny, tmp_path, capfd):
    """A file with an MTP block after the trunk (nextn_predict_layers 1): the trunk runs as without it, and
    the load notes say it was skipped, beside the attention schedule and the KV bytes a token takes."""
    model, path, toks, ref = tiny
    n = model.config.num_hidden_layers
    mtp = str(tmp_path / "mtp.gguf")
    clamp = [float(model.config.swiglu_limit)] * (n + 1)
    more = {"block_count": n + 1, "nextn_predict_layers": 1, "attention.compress_ratios": [0, 4, 128, 4, 0],
            "swiglu_clamp_exp": clamp, "swiglu_clamp_shexp": clamp}  # fmt: skip
    rewrite_gguf(path, mtp, {f"deepseek4.{k}": v for k, v in more.items()})
    eng = Engine(mtp, EngineOptions(n_slots=64, exact=True))
    try:
        with torch.inference_mode():
            ours = eng.forward(toks[:20], 0, all_logits=True)
        assert eng.cfg.n_layers == n and eng.cfg.n_nextn == 1
    finally:
        eng.close()
    assert (ours - ref[:20]).abs().max() < 1e-3
    err = capfd.readouterr().err
    assert "1 sliding, 2 CSA 4:1, 1 HCA 128:1 (window 16)" in err
    assert "bytes per token" in err and "2 hash-routed layers" in err
    assert "MTP: 1 multi-token-prediction block(s) skipped" in err


# ---- the real converter --------------------------------------------------------------------------

# llama.cpp's converter, its vocabulary step left out (a tiny checkpoint has no DeepSeek tokenizer to read)
RUN_CONVERTER = """
import runpy, sys
src, folder, out = sys.argv[1:4]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.deepseek as ds
ds.DeepseekV4Model.set_vocab = lambda self: None
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32"]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def _values(t) -> np.ndarray:
    if t.tensor_type == T.I32:
        return np.asarray(t.data).reshape(-1)
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)


@pytest.mark.slow
def test_the_real_converter_writes_what_our_writer_writes(tmp_path):
    """DeepSeek's checkpoint layout (FP4 experts with E8M0 scales, the only layout llama.cpp's converter
    reads) through the converter of the llama-cpp-python 0.3.36 sdist: its file has our writer's tensors
    (names, shapes, values; the experts as MXFP4 holding the same values) and keys, and moestream runs it
    as transformers does."""
    src = converter_source()
    if src is None:
        pytest.skip("the llama-cpp-python sdist (its converter) could not be had: no network and no LLAMA_CPP_SRC")
    model = DEEPSEEK_V4.hf_model(seed=4)
    snap_experts_to_mxfp4(model)
    folder, theirs, ours = tmp_path / "ckpt", str(tmp_path / "theirs.gguf"), str(tmp_path / "ours.gguf")
    write_deepseek_checkpoint(model, folder)
    run = subprocess.run([sys.executable, "-c", RUN_CONVERTER, str(src), str(folder), theirs],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    DEEPSEEK_V4.write(model, ours, tokenizer_md={})
    r, o = GGUFReader(theirs), GGUFReader(ours)
    rt, ot = {t.name: t for t in r.tensors}, {t.name: t for t in o.tensors}
    assert set(rt) == set(ot)
    for name, t in rt.items():
        assert t.shape.tolist() == ot[name].shape.tolist(), name
        want = T.MXFP4 if "_exps." in name else (T.I32 if "tid2eid" in name else T.F32)
        assert t.tensor_type == want, name
        np.testing.assert_array_equal(_values(t), _values(ot[name]), err_msg=name)
    keys = {k for k in o.fields if k.startswith("deepseek4.")}  # the architecture's keys, every one
    assert keys == {k for k in r.fields if k.startswith("deepseek4.")}, keys ^ {k for k in r.fields}
    for k in keys:
        assert np.allclose(r.fields[k].parts[-1], o.fields[k].parts[-1]), k
    toks = random_tokens(160, model.config.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float()
    eng = Engine(theirs, EngineOptions(n_slots=64, exact=True))
    try:
        with torch.inference_mode():
            got = eng.forward(toks, 0, all_logits=True)
    finally:
        eng.close()
    assert (got - ref).abs().max() < 1e-3


# ---- synth shapes --------------------------------------------------------------------------------


def test_synth_shapes_have_v4s_sizes_and_a_tiny_one_streams_and_loads_in_llama_cpp(tmp_path, monkeypatch):
    """deepseek-v4-flash as MXFP4 is the ~145 GiB the published GGUFs are, a slice keeps its per-layer size;
    the tiny shape in the converter's MXFP4 mix gives the same tokens whether its experts stream or not, and
    llama.cpp computes the same logits from it."""
    flash = synth_nbytes("deepseek-v4-flash", "MXFP4")
    assert 140 << 30 < flash < 150 << 30
    assert synth_nbytes("deepseek-v4-pro", "MXFP4") > 5 * flash
    six = synth_nbytes("deepseek-v4-flash", "MXFP4", layers=6)
    assert 6 * (3 << 30) < six < flash / 5  # each layer's experts: 256 x 3 x 4096 x 2048 MXFP4 values (~3.2 GiB)
    path = write_synth("tiny-deepseek4", "MXFP4", tmp_path / "t.gguf", progress=False)
    prompt = list(range(20, 300))
    runs = []
    for slots in (64, 4):
        eng = Engine(path, EngineOptions(n_slots=slots))
        try:
            runs.append(eng.generate(prompt, 6, Sampler()).tokens)
        finally:
            eng.close()
    assert runs[0] == runs[1] and len(set(runs[0])) > 2
    llama_cpp = plain_llama_cpp(monkeypatch)
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, logits_all=True, verbose=False, n_threads=1)
    llm.eval(prompt[:200])
    ref = torch.tensor(np.asarray(llm.scores[:200]))
    llm.close()
    eng = Engine(path, EngineOptions(n_slots=64))
    try:
        with torch.inference_mode():
            ours = eng.forward(prompt[:200], 0, all_logits=True)
    finally:
        eng.close()
    assert float((ours - ref).norm() / ref.norm()) < 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_snapshot_restore_and_truncate_resume_the_compressed_cache(tiny):
    """A snapshot holds the rings and the closed windows' entries only; restored after other tokens ran, the
    continuation is the one the snapshot's moment had; a truncate within the rings' slack resumes there, one
    further back starts over."""
    _, path, toks, _ = tiny
    eng = Engine(path, EngineOptions(n_slots=64, exact=True))
    try:
        with torch.inference_mode():
            eng.forward(toks[:200], 0)
            snap = eng.kv.snapshot(200)
            assert snap.nbytes < eng.kv.nbytes  # the entry tables' unused rows are not copied
            want = eng.forward(toks[200:260], 200, all_logits=True)
            eng.forward(toks[260:300], 260)
            assert eng.kv.restore(snap, 200) == 200
            assert torch.equal(eng.forward(toks[200:260], 200, all_logits=True), want)
            assert eng.kv.truncate(230) == 230  # within the slack: resumes at 230
            resumed = eng.forward(toks[230:260], 230, all_logits=True)  # a shorter span: torch's GEMMs round apart
            assert (resumed - want[30:]).abs().max() < 1e-4
            assert eng.kv.resumable(3) == 0 and eng.kv.truncate(3) == 0  # 257 back: past the slack, start over
    finally:
        eng.close()
