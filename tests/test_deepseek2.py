"""DeepSeek-V2/V3 (deepseek2) only: the absorbed MLA form against the naive one, both kv_b forms of the
converter, greedy tokens against transformers through micro-batched prompts and streaming budgets, the
grouped routing's semantics, and the latent cache's size. The rest is in test_models.py."""

from __future__ import annotations

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import ModelFileError
from moestream.models.attention import causal_mask
from moestream.models.deepseek2 import DeepSeek2, DeepSeek2Config
from moestream.models.routing import Routing, route_general
from tests.hf_gguf import one_torch_thread, random_tokens, rel_error, rewrite_gguf
from tests.hf_gguf_deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from tests.hf_gguf_deepseek import write_deepseek2_from_hf as write

transformers = pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    model = DEEPSEEK_V3.hf_model(seed=3)
    path = str(tmp_path_factory.mktemp("v3") / "m.gguf")
    write(model, path)
    return model, path


def _greedy_hf(model, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(model(torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]


def test_absorbed_attention_equals_the_naive_form(v3):
    _, path = v3
    eng = Engine(path, EngineOptions(n_slots=8))
    try:
        attn = eng.model.layers[1].mixer
        cfg = eng.cfg
        g = torch.Generator().manual_seed(0)
        T, S, pos = 7, 30, 23  # a micro-batch at positions 23..29 over a span of 30
        q_nope = torch.randn(T, cfg.n_heads, cfg.qk_nope, generator=g)
        q_pe = torch.randn(T, cfg.n_heads, cfg.qk_rope, generator=g)
        lat = torch.randn(S, cfg.kv_lora_rank, generator=g)
        kpe = torch.randn(S, cfg.qk_rope, generator=g)
        mask = causal_mask(T, S, pos)
        naive = attn.naive(q_nope, q_pe, lat, kpe, mask)
        absorbed = attn.absorbed(q_nope, q_pe, lat, kpe, mask)
        assert rel_error(absorbed, naive) < 1e-5
        one = attn.absorbed(q_nope[-1:], q_pe[-1:], lat, kpe, None)  # the decode step's own path
        assert rel_error(one, naive[-1:]) < 1e-5
    finally:
        eng.close()


@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_native_decode_step_reads_bf16_weights_and_16_bit_caches(v3, cache):
    """The decode step's C path with bf16 up-projections and a 16-bit cache (a quantized file's: float16 by
    default, bf16 as earlier versions held it) equals the torch formula on the same values widened to float32."""
    _, path = v3
    eng = Engine(path, EngineOptions(n_slots=8))
    try:
        attn, cfg = eng.model.layers[1].mixer, eng.cfg
        g = torch.Generator().manual_seed(1)
        S = 37
        q_nope = torch.randn(1, cfg.n_heads, cfg.qk_nope, generator=g)
        q_pe = torch.randn(1, cfg.n_heads, cfg.qk_rope, generator=g)
        lat = torch.randn(S, cfg.kv_lora_rank, generator=g).to(cache)
        kpe = torch.randn(S, cfg.qk_rope, generator=g).to(cache)
        up = attn.up
        up.k_b, up.v_b = up.k_b.bfloat16(), up.v_b.bfloat16()
        got = attn.absorbed(q_nope, q_pe, lat, kpe, None)
        k_b, v_b, lf, kf = up.k_b.float(), up.v_b.float(), lat.float(), kpe.float()
        q_lat = torch.einsum("hn,hln->hl", q_nope[0], k_b)
        p = torch.softmax((q_lat @ lf.T + q_pe[0] @ kf.T) * cfg.kq_scale, dim=-1)
        want = torch.einsum("hl,hvl->hv", p @ lf, v_b)[None]
        assert rel_error(got, want) < 1e-5
    finally:
        eng.close()


def test_both_kv_b_forms_give_the_same_logits(v3, tmp_path):
    model, split = v3
    legacy = str(tmp_path / "legacy.gguf")
    write(model, legacy, kv_b_split=False)
    toks = random_tokens(24, model.config.vocab_size, seed=4)
    out = []
    for path in (split, legacy):
        eng = Engine(path, EngineOptions(n_slots=16))
        try:
            assert eng.model.layers[0].mixer.up.k_b.shape == (4, 128, 64)
            with torch.inference_mode():
                out.append(eng.forward(toks, 0, all_logits=True))
        finally:
            eng.close()
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("arch", [DEEPSEEK_V2, DEEPSEEK_V3], ids=lambda a: a.id)
def test_greedy_tokens_equal_transformers_over_micro_batches_and_streaming(tmp_path, arch):
    model = arch.hf_model(seed=5)
    path = str(tmp_path / "m.gguf")
    write(model, path)
    prompt = random_tokens(40, model.config.vocab_size, seed=5)
    want = _greedy_hf(model, prompt, 10)
    n_moe = model.config.num_hidden_layers - model.config.first_k_dense_replace
    for slots in (2, 5, n_moe * 8):  # top-k only, a few more, every expert
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=16))  # the prompt spans three micro-batches
        try:
            assert eng.generate(prompt, 10, Sampler()).tokens == want, slots
        finally:
            eng.close()


def test_grouped_routing_masks_with_minus_infinity():
    """A negative biased score in a chosen group beats every expert of a group left out (0.0 would not)."""
    logits = torch.tensor([[-4.0, -3.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5]])
    bias = torch.full((8,), -1.0)  # every biased score below zero
    r = Routing(gating="sigmoid", norm=True, scale=2.5, n_group=4, topk_group=1)
    weights, ids = route_general(logits, 2, r, bias)
    assert sorted(ids[0].tolist()) == [2, 3]  # group 1 wins on its two best (biased) scores
    probs = torch.sigmoid(logits[0, [2, 3]])
    assert torch.allclose(weights[0].sort().values, (probs / probs.sum() * 2.5).sort().values)  # unbiased


def test_group_scores_top2_and_max():
    # group 0: one strong expert; group 1: two good ones. V3 (top2 sum) picks group 1, V2 (max) group 0.
    probs = torch.tensor([[0.9, 0.0, 0.6, 0.6]])
    logits = torch.log(probs + 1e-9)
    top2 = route_general(logits, 1, Routing(gating="softmax", norm=False, n_group=2, topk_group=1))[1]
    best = route_general(logits, 1, Routing(gating="softmax", norm=False, n_group=2, topk_group=1,
                                            group_score="max"))[1]  # fmt: skip
    assert top2.item() in (2, 3) and best.item() == 0


def test_routing_refuses_nan():
    with pytest.raises(ModelFileError, match="layer 4: the router's output is not finite"):
        route_general(torch.tensor([[float("nan"), 0.0]]), 1, Routing(gating="sigmoid"), layer=4)


def test_the_test_model_routes_differently_with_groups(v3):
    """The grouping is not vacuous on the V3 test model: some tokens' choice differs without it."""
    model, _ = v3
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = x @ gate.weight.T
    r = Routing(gating="sigmoid", scale=2.5, n_group=4, topk_group=2)
    grouped = route_general(logits, 2, r, gate.e_score_correction_bias)[1].sort().values
    flat = route_general(logits, 2, Routing(gating="sigmoid", scale=2.5), gate.e_score_correction_bias)[1]
    assert not torch.equal(grouped, flat.sort().values)


def _v3_metadata() -> tuple[dict, dict]:
    """DeepSeek-V3-671B's header as the current converter writes it (no tensors needed beyond the shapes)."""
    a = "deepseek2."
    md = {a + k: v for k, v in {
        "block_count": 61, "context_length": 163840, "embedding_length": 7168, "feed_forward_length": 18432,
        "attention.head_count": 128, "attention.head_count_kv": 1, "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-6, "expert_used_count": 8, "expert_count": 256,
        "expert_group_count": 8, "expert_group_used_count": 4, "expert_gating_func": 2,
        "leading_dense_block_count": 3, "attention.q_lora_rank": 1536, "attention.kv_lora_rank": 512,
        "attention.key_length": 576, "attention.value_length": 512, "attention.key_length_mla": 192,
        "attention.value_length_mla": 128, "expert_feed_forward_length": 2048, "expert_shared_count": 1,
        "expert_weights_scale": 2.5, "expert_weights_norm": True, "rope.dimension_count": 64,
        "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 4096,
        "rope.scaling.yarn_log_multiplier": 0.1,
    }.items()}  # fmt: skip
    shapes = {"token_embd.weight": (129280, 7168), "blk.0.attn_q_a.weight": (1536, 7168),
              "blk.0.ffn_gate.weight": (18432, 7168), "blk.3.ffn_gate_shexp.weight": (2048, 7168)}  # fmt: skip
    return md, shapes


def test_v3_header_and_its_latent_cache_size():
    md, shapes = _v3_metadata()
    cfg = DeepSeek2Config.from_metadata(md, shapes)
    assert (cfg.n_layers, cfg.n_blocks, cfg.first_moe_block) == (58, 61, 3)
    assert (cfg.qk_nope, cfg.qk_rope, cfg.v_head_dim, cfg.shared_ffn) == (128, 64, 128, 2048)
    r = cfg.routing
    assert (r.gating, r.norm, r.scale, r.n_group, r.topk_group, r.group_score) == ("sigmoid", True, 2.5, 8, 4, "top2")
    # llama.cpp's kq_scale for V3: mscale = 1 + 0.1 ln 40 (mscale_all_dim 1), squared, over sqrt(192)
    assert cfg.kq_scale == pytest.approx((1 + 0.1 * torch.log(torch.tensor(40.0)).item()) ** 2 / 192**0.5)
    assert cfg.rope_mscale == 1.0
    # 576 values (512 latent + 64 rope) a token a block, bf16: what llama.cpp's MLA cache holds at F16
    assert DeepSeek2.memory(cfg).kv_nbytes(1, False) == 61 * 576 * 2
    full_kv = 61 * 128 * (192 + 128) * 2  # full keys and values a token, as without MLA
    assert full_kv / DeepSeek2.memory(cfg).kv_nbytes(1, False) > 70


def test_mtp_blocks_are_not_part_of_the_trunk():
    md, shapes = _v3_metadata()
    cfg = DeepSeek2Config.from_metadata(md | {"deepseek2.block_count": 62, "deepseek2.nextn_predict_layers": 1},
                                        shapes)  # fmt: skip
    assert (cfg.n_blocks, cfg.n_layers) == (61, 58)


@pytest.mark.parametrize("key,value,what", [
    ("deepseek2.expert_gating_func", 3, "expert_gating_func is 3"),
    ("deepseek2.expert_group_count", 3, "does not divide the 8 experts"),
    ("deepseek2.attention.key_length", 500, "not kv_lora_rank"),
    ("deepseek2.leading_dense_block_count", 3, "no MoE layer"),
])  # fmt: skip
def test_bad_headers_are_refused_in_one_line(v3, tmp_path, key, value, what):
    _, path = v3
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(path, bad, {key: value})
    with pytest.raises(ModelFileError, match=what):
        Engine(str(bad), EngineOptions(n_slots=8))
