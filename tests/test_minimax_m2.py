"""MiniMax-M2 (minimax-m2) only: greedy tokens and last-position logits against transformers through
micro-batched prompts and streaming budgets, the converter's own file (llama.cpp's convert_hf_to_gguf.py on a
saved checkpoint) equal to the tests' writer and to transformers, what the header sets, and bad headers. The
rest (every position's logits, batching, long prompts, llama.cpp reading the file) is test_models.py's
minimax-m2 case."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import ModelFileError
from moestream.models.minimax_m2 import MiniMaxM2Config
from moestream.models.routing import Routing
from tests.hf_gguf import one_torch_thread, random_tokens, rel_error, rewrite_gguf
from tests.hf_gguf_minimax import MINIMAX_M2, rotary_dim
from tests.hf_gguf_minimax import write_minimax_m2_from_hf as write

transformers = pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def _greedy_hf(model, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(model(torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, its file): one random model for the tests of this file (building it is most of their time)."""
    model = MINIMAX_M2.hf_model(seed=5)
    path = tmp_path_factory.mktemp("minimax") / "m.gguf"
    write(model, path)
    return model, str(path)


def test_greedy_tokens_equal_transformers_over_micro_batches_and_streaming(tiny):
    model, path = tiny
    prompt = random_tokens(40, model.config.vocab_size, seed=5)
    want = _greedy_hf(model, prompt, 10)
    with torch.no_grad():
        last = model(torch.tensor([prompt])).logits[0, -1]
    n_layers = model.config.num_hidden_layers
    for slots in (2, n_layers * 8):  # top-k only (most experts read from disk), every expert
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=16))  # the prompt spans three micro-batches
        try:
            with torch.inference_mode():
                for s in range(0, len(prompt), 16):
                    ours = eng.forward(prompt[s : s + 16], s)
            assert rel_error(ours, last) < 1e-3, slots
            eng.reset()
            assert eng.generate(prompt, 10, Sampler()).tokens == want, slots
            assert eng.cache.used_slots <= slots
        finally:
            eng.close()


def test_the_header_sets_partial_rope_and_sigmoid_routing(tiny):
    model, path = tiny
    eng = Engine(path, EngineOptions(n_slots=16))
    try:
        cfg = eng.cfg
        assert cfg.rope_dim == rotary_dim(model.config) == cfg.head_dim // 2
        assert cfg.routing == Routing(gating="sigmoid", norm=True)
        assert eng.model.rope.rot_dim == cfg.rope_dim
        attn = eng.model.layers[0].mixer
        assert attn.q_norm.shape == (cfg.n_heads * cfg.head_dim,)  # over the whole projection, not per head
        assert eng.model.layers[0].ffn.bias is not None  # the correction bias steers the choice
    finally:
        eng.close()


@pytest.mark.parametrize(
    "key, value, says",
    [("minimax-m2.rope.dimension_count", 65, "even"), ("minimax-m2.rope.dimension_count", 256, "at most"),
     ("minimax-m2.expert_gating_func", 3, "sigmoid"), ("minimax-m2.expert_weights_scale", -1.0, "> 0")],
)  # fmt: skip
def test_bad_headers_are_explained(tiny, tmp_path, key, value, says):
    path = tiny[1]
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(path, bad, metadata={key: value})
    with pytest.raises(ModelFileError, match=says) as e:
        Engine(str(bad), EngineOptions(n_slots=16)).close()
    assert key.split(".", 1)[1] in str(e.value)


def test_config_reads_the_real_header():
    """MiniMax-M2's own header (the converter's keys for its config.json): the real dims."""
    a = "minimax-m2."
    md = {a + "block_count": 62, a + "context_length": 196608, a + "embedding_length": 3072,
          a + "feed_forward_length": 1536, a + "attention.head_count": 48, a + "attention.head_count_kv": 8,
          a + "rope.freq_base": 5e6, a + "attention.layer_norm_rms_epsilon": 1e-6, a + "expert_count": 256,
          a + "expert_used_count": 8, a + "expert_gating_func": 2, a + "attention.key_length": 128,
          a + "attention.value_length": 128, a + "expert_feed_forward_length": 1536,
          a + "rope.dimension_count": 64}  # fmt: skip
    cfg = MiniMaxM2Config.from_metadata(md, {"token_embd.weight": (200064, 3072)})
    attention = (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim)
    assert attention == (62, 3072, 48, 8, 128, 64)
    assert (cfg.n_experts, cfg.top_k, cfg.expert_ffn, cfg.vocab_size) == (256, 8, 1536, 200064)


@pytest.mark.slow
def test_the_real_converter_writes_what_the_writer_writes(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py on the saved checkpoint (config.json given the rotary_dim and
    scoring_func it needs, which transformers does not write): the same minimax-m2 keys and values, the same
    tensors bit for bit, and the engine on its file within 1e-3 of transformers."""
    from tests.hf_checkpoint import write_tokenizer
    from tests.llama_cpp_converter import convert, converter_source

    src = converter_source()
    if src is None:
        pytest.skip("llama.cpp's converter source could not be had (set LLAMA_CPP_SRC or allow pip download)")
    model = MINIMAX_M2.hf_model(seed=4)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    write_tokenizer(str(ckpt))
    conf = json.loads((ckpt / "config.json").read_text())
    conf |= {"rotary_dim": rotary_dim(model.config), "scoring_func": "sigmoid"}
    (ckpt / "config.json").write_text(json.dumps(conf))
    theirs, ours = tmp_path / "conv.gguf", tmp_path / "ours.gguf"
    convert(src, ckpt, theirs)
    write(model, ours)
    r, o = GGUFReader(theirs), GGUFReader(ours)
    keys = {k for k in r.fields if k.startswith("minimax-m2.")} | {"general.architecture", "general.file_type"}
    assert keys == {k for k in o.fields if k.startswith("minimax-m2.")} | {"general.architecture", "general.file_type"}
    for k in keys:
        assert r.fields[k].types == o.fields[k].types, k
        assert np.array_equal(r.fields[k].parts[-1], o.fields[k].parts[-1]), k
    tr, to = {t.name: t for t in r.tensors}, {t.name: t for t in o.tensors}
    assert set(tr) == set(to)
    for name, t in tr.items():
        assert t.tensor_type == to[name].tensor_type and t.shape.tolist() == to[name].shape.tolist(), name
        assert np.array_equal(t.data, to[name].data), name
    toks = random_tokens(30, model.config.vocab_size, seed=4)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0]
    eng = Engine(str(theirs), EngineOptions(n_slots=32, exact=True))
    try:
        with torch.inference_mode():
            assert (eng.forward(toks, 0, all_logits=True) - ref).abs().max() < 1e-3
    finally:
        eng.close()


def test_a_long_prompt_in_spans_under_a_budget_equals_transformers(tiny):
    """A 700-token prompt (spans of 256, attention in query chunks, 3 expert slots: most experts read from
    disk) in exact mode: every position's logits within 1e-3 of transformers'."""
    model, path = tiny
    prompt = random_tokens(700, model.config.vocab_size, seed=8)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    eng = Engine(path, EngineOptions(n_slots=3, exact=True, ubatch=64, prefill_span=256))
    try:
        with torch.inference_mode():
            ours = torch.cat([eng.forward(prompt[s : s + 256], s, all_logits=True) for s in range(0, 700, 256)])
        assert (ours - ref).abs().max() < 1e-3
    finally:
        eng.close()
