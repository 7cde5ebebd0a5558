"""GLM-4.5/4.5-Air/4.6 (glm4moe) only: greedy tokens and last-position logits against transformers through
micro-batched prompts and streaming budgets, the MTP block the converter appends (never loaded, never
counted), the routing and rope the header sets, GLM-4.5's real header, and bad headers. The rest is in
test_models.py."""

from __future__ import annotations

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.model_file import dense_estimate, open_model, trunk_blocks
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import ModelFileError
from moestream.formats.gguf_file import GGUFFile
from moestream.formats.gguf_model import GGUFModel
from moestream.models.glm4moe import Glm4Moe, Glm4MoeConfig
from moestream.models.routing import Routing, route_general
from tests.hf_gguf import one_torch_thread, random_tokens, rel_error, rewrite_gguf
from tests.hf_gguf_glm import GLM4MOE, GLM45_AIR
from tests.hf_gguf_glm import write_glm4moe_from_hf as write

transformers = pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(model, file with the MTP block, the same file as --no-mtp writes it)."""
    model = GLM4MOE.hf_model(seed=3)
    d = tmp_path_factory.mktemp("glm")
    write(model, d / "m.gguf")
    write(model, d / "no_mtp.gguf", mtp=False)
    return model, str(d / "m.gguf"), str(d / "no_mtp.gguf")


def _greedy_hf(model, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(model(torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]


@pytest.mark.parametrize("arch", [GLM4MOE, GLM45_AIR], ids=lambda a: a.id)
def test_greedy_tokens_equal_transformers_over_micro_batches_and_streaming(tmp_path, arch):
    model = arch.hf_model(seed=5)
    path = str(tmp_path / "m.gguf")
    write(model, path)
    prompt = random_tokens(40, model.config.vocab_size, seed=5)
    want = _greedy_hf(model, prompt, 10)
    with torch.no_grad():
        last = model(torch.tensor([prompt])).logits[0, -1]
    n_moe = model.config.num_hidden_layers - model.config.first_k_dense_replace
    for slots in (2, 5, n_moe * 8):  # top-k only, a few more, every expert
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


def test_the_mtp_block_is_never_loaded(glm, monkeypatch):
    model, path, no_mtp = glm
    f = GGUFFile(path)
    n = model.config.num_hidden_layers
    assert f.metadata["glm4moe.block_count"] == n + 1 and f.metadata["glm4moe.nextn_predict_layers"] == 1
    assert {f"blk.{n}.nextn.eh_proj.weight", f"blk.{n}.ffn_gate_exps.weight"} <= set(f.tensors)
    f.close()
    read: list[str] = []
    real_read = GGUFModel.read  # what the engine reads weights through (whole or split files alike)
    monkeypatch.setattr(GGUFModel, "read", lambda self, name: read.append(name) or real_read(self, name))
    outputs = []
    for p in (path, no_mtp):
        eng = Engine(p, EngineOptions(n_slots=4, ubatch=16))
        try:
            assert (eng.cfg.n_blocks, eng.cfg.n_layers, eng.store.n_layers) == (n, n - 1, n - 1)
            assert len(eng.model.layers) == n
            outputs.append(eng.generate(random_tokens(20, model.config.vocab_size, seed=6), 6, Sampler()).tokens)
        finally:
            eng.close()
    assert read and not [name for name in read if name.startswith(f"blk.{n}.")]
    assert outputs[0] == outputs[1]


def test_the_budget_counts_the_trunk_not_the_mtp_block(glm):
    _, path, no_mtp = glm
    m, bare = open_model(path), open_model(no_mtp)
    try:
        trunk = dense_estimate(m.gguf, m.exact, trunk_blocks(m.cfg))
        assert trunk == dense_estimate(bare.gguf, bare.exact, trunk_blocks(bare.cfg))
        assert dense_estimate(m.gguf, m.exact) > trunk  # what counting every block in the file would add
        assert m.store.slot_nbytes == bare.store.slot_nbytes
        assert m.store.total_file_nbytes == bare.store.total_file_nbytes  # its experts are no slots' business
    finally:
        m.close()
        bare.close()
    eng = Engine(path, EngineOptions(n_slots=4))
    try:  # the estimate is what loading the trunk's dense weights (dense blocks, shared experts) really takes
        assert eng.model.dense_nbytes == trunk
    finally:
        eng.close()


def test_routing_and_rope_read_from_the_header(glm):
    model, path, _ = glm
    eng = Engine(path, EngineOptions(n_slots=4))
    try:
        cfg = eng.cfg
        r = cfg.routing
        assert (r.gating, r.norm, r.scale, r.n_group, r.topk_group) == ("sigmoid", True, 2.5, 2, 1)
        assert r.group_score == "top2"
        assert eng.model.rope.rot_dim == cfg.rope_dim == 32 and cfg.head_dim == 64
        attn = eng.model.layers[1].mixer
        assert attn.q_norm is not None and attn.k_norm is not None and attn.bias is not None
    finally:
        eng.close()


def test_the_test_model_routes_differently_with_groups(glm):
    """The grouping is not vacuous on the test model: some tokens' choice differs without it."""
    model, _, _ = glm
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = x @ gate.weight.T
    r = Routing(gating="sigmoid", scale=2.5, n_group=2, topk_group=1)
    grouped = route_general(logits, 2, r, gate.e_score_correction_bias)[1].sort().values
    flat = route_general(logits, 2, Routing(gating="sigmoid", scale=2.5), gate.e_score_correction_bias)[1]
    assert not torch.equal(grouped, flat.sort().values)


def test_partial_rotary_matters(glm, tmp_path):
    """Rotating the whole head instead of its first half changes the logits: rope.dimension_count is read."""
    model, path, _ = glm
    full = tmp_path / "full.gguf"
    rewrite_gguf(path, full, {"glm4moe.rope.dimension_count": model.config.head_dim})
    toks = random_tokens(24, model.config.vocab_size, seed=4)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0]
    errors = []
    for p in (path, str(full)):
        eng = Engine(p, EngineOptions(n_slots=16))
        try:
            with torch.inference_mode():
                errors.append(rel_error(eng.forward(toks, 0, all_logits=True), ref))
        finally:
            eng.close()
    assert errors[0] < 1e-5 < 1e-2 < errors[1]


def test_air_has_no_qk_norm_and_no_groups(tmp_path):
    model = GLM45_AIR.hf_model(seed=1)
    path = tmp_path / "air.gguf"
    write(model, path)
    f = GGUFFile(path)
    assert not any("attn_q_norm" in name for name in f.tensors)
    f.close()
    eng = Engine(str(path), EngineOptions(n_slots=4))
    try:
        assert eng.model.layers[1].mixer.q_norm is None
        assert (eng.cfg.routing.n_group, eng.cfg.routing.scale) == (1, 1.0)
    finally:
        eng.close()


def _glm45_metadata() -> tuple[dict, dict]:
    """GLM-4.5 (355B-A32B)'s header as the converter writes it (no tensors needed beyond the shapes)."""
    a = "glm4moe."
    md = {a + k: v for k, v in {
        "block_count": 93, "context_length": 131072, "embedding_length": 5120, "feed_forward_length": 12288,
        "attention.head_count": 96, "attention.head_count_kv": 8, "rope.freq_base": 1_000_000.0,
        "attention.layer_norm_rms_epsilon": 1e-5, "expert_used_count": 8, "expert_group_count": 1,
        "expert_group_used_count": 1, "attention.key_length": 128, "attention.value_length": 128,
        "rope.dimension_count": 64, "expert_count": 160, "expert_feed_forward_length": 1536,
        "expert_shared_count": 1, "leading_dense_block_count": 3, "expert_gating_func": 2,
        "expert_weights_scale": 2.5, "expert_weights_norm": True, "nextn_predict_layers": 1,
    }.items()}  # fmt: skip
    shapes = {"token_embd.weight": (151552, 5120), "blk.0.ffn_gate.weight": (12288, 5120),
              "blk.3.ffn_gate_shexp.weight": (1536, 5120)}  # fmt: skip
    return md, shapes


def test_glm45_header_and_its_cache_size():
    md, shapes = _glm45_metadata()
    cfg = Glm4MoeConfig.from_metadata(md, shapes)
    assert (cfg.n_blocks, cfg.n_layers, cfg.first_moe_block) == (92, 89, 3)
    assert (cfg.head_dim, cfg.rope_dim, cfg.n_kv_heads, cfg.shared_ffn, cfg.dense_ffn) == (128, 64, 8, 1536, 12288)
    r = cfg.routing
    assert (r.gating, r.norm, r.scale, r.n_group) == ("sigmoid", True, 2.5, 1)
    # keys and values of 8 kv heads x 128 in each of the 92 trunk blocks (not the MTP block), bf16
    assert Glm4Moe.memory(cfg).kv_nbytes(1, False) == 92 * 2 * 8 * 128 * 2


@pytest.mark.parametrize("key,value,what", [
    ("glm4moe.nextn_predict_layers", 4, "the trunk would be empty"),
    ("glm4moe.leading_dense_block_count", 3, "no MoE layer"),
    ("glm4moe.rope.dimension_count", 65, "must be even and at most the head size 64"),
    ("glm4moe.rope.dimension_count", 128, "must be even and at most the head size 64"),
    ("glm4moe.expert_gating_func", 3, "expert_gating_func is 3"),
    ("glm4moe.expert_group_count", 3, "does not divide the 8 experts"),
    ("glm4moe.attention.value_length", 32, "not the key length 64"),
    ("glm4moe.rope.scaling.type", "yarn", "linear rope scaling or none"),
])  # fmt: skip
def test_bad_headers_are_refused_in_one_line(glm, tmp_path, key, value, what):
    _, path, _ = glm
    bad = tmp_path / "bad.gguf"
    extra = {"glm4moe.rope.scaling.factor": 4.0} if key.endswith("scaling.type") else {}
    rewrite_gguf(path, bad, {key: value} | extra)
    with pytest.raises(ModelFileError, match=what):
        Engine(str(bad), EngineOptions(n_slots=8))
