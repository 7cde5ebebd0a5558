"""GLM-5.3-Flash (glm5-next) against transformers, on a tiny random model written by llama.cpp's own converter
(tests/hf_gguf_glm5_next.py): every position's logits within 1e-3 through a prompt of micro-batches past
the pooled indexer's top-k and decode steps after it; greedy tokens alone, under a budget that streams and in
a batch; a decode step's attention bounded by the choice; the choice mattering; the schedule and what the
header sets; bad headers refused in one line. The shared tests (test_models.py, its glm-5.3-flash case:
slow) add prompt reuse over the KDA checkpoints, the quantized types and the budget's count of the cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import ModelFileError
from moestream.models.glm5_next import Glm5Next
from moestream.models.kda import KimiDeltaAttention
from tests.hf_gguf import one_torch_thread, random_tokens, rewrite_gguf
from tests.hf_gguf_glm5_next import GLM5_NEXT, INDEX_TOP_K, KPOOL
from tests.test_batch import Stepper

transformers = pytest.importorskip("transformers")
one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)

N_LONG = 150  # a prompt of several micro-batches, most of its queries seeing more pools than they may choose
ATTENDS = [False, True, True, False, True]  # the tiny schedule: KDA, full, shared, KDA, full
MOST = INDEX_TOP_K + KPOOL - 1  # keys a query may attend to: its chosen pools and its own incomplete one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(file, tokens, transformers' logits at every position, model)."""
    model = GLM5_NEXT.hf_model(seed=5)
    path = str(tmp_path_factory.mktemp("glm5next") / "m.gguf")
    GLM5_NEXT.write(model, path)
    toks = random_tokens(N_LONG + 8, model.config.vocab_size, seed=5)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float()
    return path, toks, ref, model


def _greedy_hf(model, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(model(torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]


@pytest.mark.parametrize("ubatch", [16, 64])
def test_long_prompt_in_micro_batches_matches_transformers(tiny, ubatch):
    """Spans of 16 or 64 queries (most past the top-k pools) and decode steps after them, in exact mode: every
    position's logits within 1e-3 of transformers' float32."""
    path, toks, ref, _ = tiny
    eng = Engine(path, EngineOptions(n_slots=64, exact=True, ubatch=ubatch))
    try:
        with torch.inference_mode():
            got = [eng.forward(toks[a : min(a + ubatch, N_LONG)], a, all_logits=True) for a in range(0, N_LONG, ubatch)]
            assert (torch.cat(got) - ref[:N_LONG]).abs().max() < 1e-3
            for j in range(N_LONG, N_LONG + 8):
                assert (eng.forward([toks[j]], j) - ref[j]).abs().max() < 1e-3, j
    finally:
        eng.close()


def test_a_decode_step_attends_to_its_chosen_pools(tiny):
    """Before a query sees more pools than it may choose it attends to every position; after, to its top_k /
    kpool pools and its own incomplete pool (at most top_k + kpool - 1 keys), however long the context; the
    KDA blocks attend to nothing."""
    path, toks, _, _ = tiny
    eng = Engine(path, EngineOptions(n_slots=64, exact=True))
    try:
        with torch.inference_mode():
            eng.forward(toks[:20], 0)
            eng.forward([toks[20]], 20)
            assert eng.kv.keys_attended == [21 if a else 0 for a in ATTENDS]
            eng.forward(toks[21:N_LONG], 21)
            for pos in range(N_LONG, N_LONG + KPOOL):
                eng.forward([toks[pos]], pos)
                tail = (pos + 1) % KPOOL
                assert eng.kv.keys_attended == [INDEX_TOP_K + tail if a else 0 for a in ATTENDS]
                assert max(eng.kv.keys_attended) <= MOST
    finally:
        eng.close()


def test_the_choice_matters(tiny):
    """The dense reference (the same model choosing every pool) differs from the sparse one once a query sees
    more pools than it may choose, by far more than the tolerance; before, not at all."""
    _, toks, ref, model = tiny
    seen = INDEX_TOP_K + KPOOL  # the first query that sees top_k / kpool + 1 complete pools is at seen - 1
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
    assert (dense[: seen - 1] - ref[: seen - 1]).abs().max() < 1e-4
    assert (dense[seen - 1 : 80] - ref[seen - 1 : 80]).abs().max() > 0.1


def test_greedy_equals_transformers_alone_streamed_and_batched(tiny):
    """Greedy tokens past the top-k: transformers', with every expert cached, under a budget that streams
    most of them, and decoded in a batch beside another sequence."""
    path, toks, _, model = tiny
    prompt, n = toks[:60], 8
    want = _greedy_hf(model, prompt, n)
    cfg = model.config.text_config
    for slots in (cfg.num_hidden_layers * cfg.n_routed_experts, cfg.num_experts_per_tok + 1):
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=16))
        try:
            assert eng.generate(prompt, n, Sampler()).tokens == want, slots
            assert eng.cache.used_slots <= slots
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
    finally:
        eng.close()


def test_the_header_sets_the_schedule_pools_and_streams(tiny):
    path, *_ = tiny
    eng = Engine(path, EngineOptions(n_slots=16))
    try:
        cfg = eng.cfg
        assert cfg.kda.recurrent == tuple(not a for a in ATTENDS) and cfg.indexer.full == (
            False,
            True,
            False,
            False,
            True,
        )
        assert (cfg.kpool, cfg.select_tail, cfg.qk_rope, cfg.hc_mult, cfg.first_moe_block) == (KPOOL, True, 0, 4, 1)
        assert cfg.kda.lower_bound == -5.0 and cfg.clamp_exp == (10.0,) * 5 and cfg.routing.gating == "sigmoid"
        layers = eng.model.layers
        assert [isinstance(b.mixer, KimiDeltaAttention) for b in layers] == [not a for a in ATTENDS]
        assert not hasattr(layers[2].mixer, "pool_ape") and hasattr(layers[1].mixer, "pool_ape")
        assert eng.kv.index_keys[2] is None and eng.kv.latent[0] is None and eng.kv.latent[2] is not None
    finally:
        eng.close()
    notes = Glm5Next.load_notes(type(cfg)(**{**cfg.__dict__, "nextn": 1}))
    assert "2 Kimi Delta Attention" in notes[0] and "top 8 pools of 4" in notes[0]
    assert "multi-token-prediction" in notes[1] and "skipped" in notes[1]


def test_an_mtp_block_is_skipped_and_said(tiny, tmp_path, capfd):
    """A file whose header counts a next-n (MTP) block after the trunk, as the converter writes one
    (block_count + 1, nextn_predict_layers, the per-block arrays one longer): the trunk runs as without it and
    the load summary says the block was skipped."""
    path, toks, ref, _ = tiny
    mtp = str(tmp_path / "mtp.gguf")
    more = {"block_count": 6, "nextn_predict_layers": 1, "attention.head_count_kv": [0, 1, 1, 0, 1, 1],
            "attention.indexer.types": [True, True, False, True, True, True],
            "swiglu_clamp_exp": [10.0] * 6, "swiglu_clamp_shexp": [10.0] * 6}  # fmt: skip
    rewrite_gguf(path, mtp, {f"glm5-next.{k}": v for k, v in more.items()})
    eng = Engine(mtp, EngineOptions(n_slots=64, exact=True))
    try:
        with torch.inference_mode():
            ours = eng.forward(toks[:40], 0, all_logits=True)
        assert (eng.cfg.n_blocks, eng.cfg.nextn) == (5, 1)
    finally:
        eng.close()
    assert (ours - ref[:40]).abs().max() < 1e-3
    err = capfd.readouterr().err
    assert "3 latent attention without rope" in err
    assert "1 multi-token-prediction (next-n) block(s) are skipped" in err


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("attention.indexer.kpool", 5, "must divide the index top_k"),
        ("hyper_connection.count", None, "is missing"),
        ("attention.head_count_kv", [0, 0, 0, 0, 0], "every block a linear one"),
        ("kda.gate_lower_bound", 2.0, "finite negative number"),
        ("attention.indexer.types", [True, False, True, True, True], "first block a shared one"),
    ],
)
def test_bad_keys_are_refused_in_one_line(tiny, tmp_path, key, value, words):
    path, *_ = tiny
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(path, bad, {f"glm5-next.{key}": value})
    with pytest.raises(ModelFileError, match=words) as err:
        Engine(str(bad), EngineOptions(n_slots=8)).close()
    assert "\n" not in str(err.value) and key in str(err.value)


# ---- synth shapes ----------------------------------------------------------------------------------------


def test_synth_tiny_glm5_next_runs_the_same_streamed(tmp_path):
    from moestream.synth.shapes import write_synth

    path = write_synth("tiny-glm5-next", "Q8_0", tmp_path / "m.gguf", progress=False)
    prompt = list(range(20, 60))
    eng = Engine(path, EngineOptions(n_slots=200, threads=1))
    try:
        assert eng.cfg.kda.recurrent == (True, True, True, False) * 2
        full = eng.generate(prompt, 8, Sampler()).tokens
        assert eng.kv.keys_attended[3] <= 16 + 3 and eng.kv.keys_attended[0] == 0
    finally:
        eng.close()
    assert len(set(full)) > 2
    eng = Engine(path, EngineOptions(n_slots=6, threads=1))
    try:
        assert eng.generate(prompt, 8, Sampler()).tokens == full
    finally:
        eng.close()


def test_synth_real_shape_and_its_slices_read_as_the_model():
    """glm-5.3-flash at its real size (and a 6-block --layers slice): the config read from the keys and tensor
    table synth writes (without writing the file), and its size."""
    from gguf import GGMLQuantizationType as Q

    from moestream.models.glm5_next import Glm5NextConfig
    from moestream.synth.shapes import _resolve, synth_nbytes

    for layers, n in ((None, 45), (6, 6)):
        s = _resolve("glm-5.3-flash", layers)
        shapes = {t.name: t.shape for t in s.tensors(Q.Q4_K, Q.Q4_K, 1000, 0, k_m=True)}
        cfg = Glm5NextConfig.from_metadata(s.metadata("glm-5.3-flash", 15, 1000), shapes)
        assert (cfg.n_blocks, cfg.first_moe_block, cfg.hidden, cfg.n_experts, cfg.top_k) == (n, 3, 4096, 288, 8)
        assert (cfg.n_attention, cfg.kda.heads, cfg.kda.head_dim, cfg.n_heads) == (n // 4, 64, 128, 64)
        assert (cfg.indexer.heads, cfg.indexer.head_dim, cfg.indexer.top_k, cfg.kpool) == (32, 128, 2048, 16)
        assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_rope, cfg.v_head_dim) == (1536, 512, 256, 0, 256)
        assert cfg.indexer.full == tuple(i % 4 == 3 for i in range(n)) and cfg.hc_mult == 4
    assert 170e9 < synth_nbytes("glm-5.3-flash", "Q4_K_M") < 210e9
    assert synth_nbytes("glm-5.3-flash", "Q4_K_M", 6) < 0.2 * synth_nbytes("glm-5.3-flash", "Q4_K_M")


@pytest.mark.slow
def test_synth_table_and_keys_are_the_converters(tmp_path):
    """tiny-glm5-next's file against llama.cpp's converter (--outtype q8_0) on a transformers model of the same
    sizes: the same tensors (names, shapes, which stay F32) and the same keys and values, tokenizer aside."""
    from gguf import GGUFReader

    from moestream.synth.shapes import write_synth
    from tests.hf_gguf_glm5_next import save_checkpoint
    from tests.llama_cpp_converter import convert, converter_source

    src = converter_source()
    if src is None:
        pytest.skip("llama.cpp's converter could not be had: no network and no LLAMA_CPP_SRC")
    model = GLM5_NEXT.hf_model(num_hidden_layers=8, n_routed_experts=16, num_experts_per_tok=4, index_topk=16)
    save_checkpoint(model, tmp_path / "ckpt")
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    convert(src, tmp_path / "ckpt", theirs, outtype="q8_0")
    write_synth("tiny-glm5-next", "Q8_0", ours, progress=False)
    r, o = GGUFReader(theirs), GGUFReader(ours)
    want = {t.name: (t.shape.tolist(), t.tensor_type) for t in r.tensors}
    assert {t.name: (t.shape.tolist(), t.tensor_type) for t in o.tensors} == want
    skip = ("general.", "tokenizer.", "GGUF.")
    keys = {k for k in r.fields if not k.startswith(skip)}
    assert {k for k in o.fields if not k.startswith(skip)} == keys
    for k in keys:
        assert r.fields[k].types == o.fields[k].types, k
        assert np.allclose(r.fields[k].parts[-1], o.fields[k].parts[-1]), k
