"""Qwen3.5-MoE only (hybrid Gated DeltaNet + gated attention): the delta rule, recurrent state, checkpoints,
metadata variants. Logits against transformers and streaming are in test_models.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as T

from moestream.compute import native
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.formats.gguf_file import GGUFFile
from moestream.models.deltanet import CHUNK, causal_conv, chunk_delta_rule, delta_rule_span, delta_rule_step
from moestream.models.loader import GGUFWeights
from moestream.models.qwen35moe import Qwen35MoeConfig
from tests.hf_gguf import QWEN35MOE, one_torch_thread, random_tokens, rel_error, write_qwen35moe_from_hf

transformers = pytest.importorskip("transformers")

N_PROMPT, N_DECODE = 80, 16  # the prompt is longer than one DeltaNet chunk (64)


one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model file, tokens, transformers' logits for every position of prompt + decoded tokens)."""
    model = QWEN35MOE.hf_model()
    path = str(tmp_path_factory.mktemp("q35") / "m.gguf")
    write_qwen35moe_from_hf(model, path)
    toks = random_tokens(N_PROMPT + N_DECODE, model.config.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float()
    return path, toks, ref, model


def _engine(path: str, **kw) -> Engine:
    return Engine(path, EngineOptions(n_slots=kw.pop("n_slots", 32), **kw))


def test_config_from_gguf(tiny):
    path, *_ = tiny
    f = GGUFFile(path)
    cfg = Qwen35MoeConfig.from_metadata(f.metadata, {n: t.shape for n, t in f.tensors.items()}, path)
    f.close()
    assert cfg.recurrent == [True, False, True, False]
    assert (cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv_kernel) == (2, 4, 64, 64, 4)
    assert (cfg.rot_dim, cfg.head_dim, cfg.shared_ffn, cfg.rope_theta) == (16, 64, 256, 1e7)


def test_delta_rule_chunked_equals_recurrent_and_transformers():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_recurrent_gated_delta_rule

    H, L, dk, dv = 3, CHUNK + 37, 16, 8
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(H, L, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(H, L, dv, generator=g)
    decay = -torch.rand(H, L, generator=g) * 4  # strong and weak forgetting
    beta = torch.rand(H, L, generator=g)
    S0 = torch.randn(H, dk, dv, generator=g)
    S_chunk, S_step = S0.clone(), S0.clone()
    o_chunk = chunk_delta_rule(q, k, v, decay, beta, S_chunk)
    qt, kt, vt, dt, bt = (x.transpose(0, 1) for x in (q, k, v, decay, beta))  # token-major, as the model has
    o_step = torch.cat([delta_rule_step(qt[t:t + 1], kt[t:t + 1], vt[t:t + 1], dt[t:t + 1], bt[t:t + 1], S_step)
                        for t in range(L)]).transpose(0, 1)  # fmt: skip
    ref, S_ref = torch_recurrent_gated_delta_rule(
        *(x.transpose(0, 1)[None] for x in (q * dk**0.5, k, v)),  # transformers scales q by 1/sqrt(dk) itself
        g=decay.T[None],
        beta=beta.T[None],
        initial_state=S0[None].clone(),
        output_final_state=True,
    )
    assert rel_error(o_chunk, o_step) < 1e-5 and rel_error(S_chunk, S_step) < 1e-5
    assert rel_error(o_step, ref[0].transpose(0, 1)) < 1e-5 and rel_error(S_step, S_ref[0]) < 1e-5


@pytest.mark.parametrize("flags", [(), ("-DMS_SCALAR",)], ids=["simd", "scalar"])
@pytest.mark.parametrize("L,Hk,Hv,dk,dv", [(1, 2, 4, 16, 8), (CHUNK, 1, 1, 8, 8), (CHUNK + 37, 2, 4, 16, 8),
                                          (3 * CHUNK + 5, 2, 6, 24, 40), (130, 4, 8, 128, 128)])  # fmt: skip
def test_native_delta_rule_equals_torch(monkeypatch, flags, L, Hk, Hv, dk, dv):
    """deltanet.c's prompt path agrees with chunk_delta_rule in torch: every head (value heads sharing key heads),
    the partial last chunk, a state carried in, and the state left behind."""
    lib = native.lib(flags)
    if lib is None:
        pytest.skip("needs the native library (a C compiler)")
    g = torch.Generator().manual_seed(L)
    qk = torch.nn.functional.normalize(torch.randn(L, 2 * Hk, dk, generator=g), dim=-1)
    v = torch.randn(L, Hv, dv, generator=g)
    decay, beta = -torch.rand(L, Hv, generator=g) * 4, torch.rand(L, Hv, generator=g)
    S0 = torch.randn(Hv, dk, dv, generator=g)
    S_native, S_torch = S0.clone(), S0.clone()
    monkeypatch.setattr(native, "lib", lambda extra_flags=(): lib)
    o_native = delta_rule_span(qk, v, decay, beta, S_native, Hk)
    monkeypatch.setattr(native, "lib", lambda extra_flags=(): None)
    o_torch = delta_rule_span(qk, v, decay, beta, S_torch, Hk)
    assert o_native.shape == o_torch.shape == (L, Hv, dv)
    assert rel_error(o_native, o_torch) < 1e-5 and rel_error(S_native, S_torch) < 1e-5


@pytest.mark.skipif(native.lane_isa() != "avx512-vnni", reason="compares the AVX2 build with the AVX-512 one")
def test_native_delta_rule_gives_the_same_bits_with_avx2(monkeypatch):
    """gemm.h's 16-float tiles take each sum in the order of the 8-float ones: this CPU's library built without
    AVX-512 gives the delta rule's output and state the same bits."""
    L, Hk, Hv, dk, dv = 3 * CHUNK + 5, 2, 4, 128, 128
    g = torch.Generator().manual_seed(L)
    qk = torch.nn.functional.normalize(torch.randn(L, 2 * Hk, dk, generator=g), dim=-1)
    v = torch.randn(L, Hv, dv, generator=g)
    decay, beta = -torch.rand(L, Hv, generator=g) * 4, torch.rand(L, Hv, generator=g)
    S0 = torch.randn(Hv, dk, dv, generator=g)
    results = []
    for lib in (native.lib(), native.lib(("-mno-avx512f",))):
        monkeypatch.setattr(native, "lib", lambda extra_flags=(), lib=lib: lib)
        state = S0.clone()
        results.append((delta_rule_span(qk, v, decay, beta, state, Hk), state))
        monkeypatch.undo()
    (o_512, s_512), (o_avx2, s_avx2) = results
    assert torch.equal(o_512.view(torch.int32), o_avx2.view(torch.int32))
    assert torch.equal(s_512.view(torch.int32), s_avx2.view(torch.int32))


@pytest.mark.parametrize("flags", [(), ("-DMS_SCALAR",)], ids=["simd", "scalar"])
@pytest.mark.parametrize("T,C,K", [(1, 24, 4), (130, 2056, 4), (5, 13, 3)])
def test_native_causal_conv_equals_torch(monkeypatch, flags, T, C, K):
    lib = native.lib(flags)
    if lib is None:
        pytest.skip("needs the native library (a C compiler)")
    g = torch.Generator().manual_seed(C)
    buf, w_t = torch.randn(T + K - 1, C, generator=g), torch.randn(K, C, generator=g)
    monkeypatch.setattr(native, "lib", lambda extra_flags=(): lib)
    got = causal_conv(buf, w_t)
    monkeypatch.setattr(native, "lib", lambda extra_flags=(): None)
    want = causal_conv(buf, w_t)
    assert got.shape == want.shape == (T, C) and rel_error(got, want) < 1e-6


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
def test_checkpoint_at_the_calls_first_token(tiny, monkeypatch, use_native):
    """A checkpoint cut at offset 0 copies the states as they came in, and the call's output is the uncut one."""
    path, *_ = tiny
    eng = _engine(path)
    try:
        if not use_native:
            monkeypatch.setattr(native, "lib", lambda extra_flags=(): None)
        mixer = eng.model.layers[0].mixer  # layer 0 is a Gated DeltaNet layer
        g = torch.Generator().manual_seed(1)
        x = torch.randn(5, eng.model.cfg.hidden, generator=g)
        conv0 = torch.randn(eng.model.cfg.conv_kernel - 1, eng.model.cfg.conv_dim, generator=g)
        S0 = torch.randn(eng.model.cfg.n_v_heads, eng.model.cfg.k_head_dim, eng.model.cfg.v_head_dim, generator=g)
        conv_a, S_a, conv_b, S_b = conv0.clone(), S0.clone(), conv0.clone(), S0.clone()
        conv_cut, S_cut = torch.empty_like(conv0), torch.empty_like(S0)
        with torch.inference_mode():
            cut = mixer.mix(x, conv_a, S_a, [(0, conv_cut, S_cut)])
            plain = mixer.mix(x, conv_b, S_b, [])
        assert torch.equal(conv_cut, conv0) and torch.equal(S_cut, S0)
        assert torch.equal(cut, plain) and torch.equal(S_a, S_b) and torch.equal(conv_a, conv_b)
    finally:
        eng.close()


def test_mtp_block_and_interval_only_metadata(tiny, tmp_path):
    """A file with an appended MTP block, or with only full_attention_interval, runs the same trunk."""
    path, toks, ref, model = tiny
    for kw in ({"nextn_block": True}, {"recurrent_layers": False, "full_attention_interval": 2}):
        p = str(tmp_path / "v.gguf")
        write_qwen35moe_from_hf(model, p, **kw)
        eng = _engine(p)
        try:
            assert eng.cfg.n_layers == 4 and eng.cfg.recurrent == [True, False, True, False]
            with torch.inference_mode():
                ours = eng.forward(toks[:20], 0)
            assert rel_error(ours, ref[19]) < 1e-3, kw
        finally:
            eng.close()


@pytest.mark.parametrize("span", [16, None], ids=["micro-batches", "span"])
def test_prompt_reuse_goes_back_to_checkpoints(tiny, span):
    """Follow-ups reuse the live state or go back to a checkpoint; either way the tokens are a fresh run's.
    Checkpoints are taken 8 tokens before and at the end of each forward call (each micro-batch, or the one
    span of a whole prompt); the last 3 are kept."""
    path, toks, _, _ = tiny
    prompt = toks[:N_PROMPT]
    eng = _engine(path, ubatch=16, prefill_span=span)
    fresh = _engine(path, ubatch=16, prefill_span=span)
    try:
        first = eng.generate(prompt, 6, Sampler())
        cases = [
            (prompt + first.tokens + [9, 10], N_PROMPT + 5),  # extends all that was run: the live state
            (prompt[:-3] + [5, 6, 7, 8], 72),  # parts at 77: back to the checkpoint 8 before the prompt's end
            (prompt[:-3] + [5, 6, 7, 8], 73),  # the same again: the checkpoint that run took after 1 token
            (prompt[:50] + [1, 2, 3], 0),  # only the last 3 checkpoints are kept: from scratch
            # the run before kept 40, 48 and 53 (micro-batches of 16), or 45 and 53 (one span)
            (prompt[:45] + [4], 40 if span else 45),
            (prompt[:5], 0),  # before any checkpoint
        ]
        for follow, reused_expected in cases:
            reused = eng.generate(follow, 6, Sampler())
            fresh.reset()
            ref = fresh.generate(follow, 6, Sampler())
            assert ref.stats.reused_tokens == 0
            assert reused.stats.reused_tokens == reused_expected, (len(follow), reused.stats.reused_tokens)
            assert reused.tokens == ref.tokens
    finally:
        eng.close()
        fresh.close()


def test_fused_projections_keep_each_kernel(tiny, tmp_path):
    """Projections of one input with the same compute form are one matmul."""
    path = str(tmp_path / "q.gguf")
    write_qwen35moe_from_hf(tiny[3], path, dense_type=T.Q4_0, expert_type=T.Q4_0)
    f = GGUFFile(path)
    w = GGUFWeights(f, exact=False)
    names = [f"blk.0.{n}.weight" for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")]
    fused = w.fused([(n, f.tensors[n].shape[0], 256) for n in names])
    if native.lane_ok():  # the lane form has no row blocking: all four are one matmul
        assert [(lin.kind, idx) for lin, idx, _ in fused.groups] == [("lane", [0, 1, 2, 3])]
    else:  # 512 + 256 rows in int4; the 4-row beta and alpha are bf16 (int4 packs rows in blocks of 64)
        assert [(lin.kind, idx) for lin, idx, _ in fused.groups] == [("int4", [0, 1]), ("bf16", [2, 3])]
    x = torch.randn(3, 256)
    for a, name in zip(fused(x), names, strict=True):
        assert torch.equal(a, w.linear(name, f.tensors[name].shape[0], 256)(x))
    f.close()


def test_failed_call_leaves_a_usable_state(tiny):
    """An error half-way through the layers (a failed read, Ctrl-C) must not leave a half-advanced state."""
    path, toks, _, _ = tiny
    eng, fresh = _engine(path, ubatch=16), _engine(path, ubatch=16)
    try:
        eng.generate(toks[:40], 4, Sampler())
        layers = eng.model.layers
        saved = layers[2]

        def interrupted(*args):
            raise KeyboardInterrupt

        layers[2] = dataclasses.replace(saved, ffn=interrupted)  # layers 0 and 1 have run when layer 2's MoE raises
        with pytest.raises(KeyboardInterrupt):
            eng.generate(toks[:40] + toks[50:60], 4, Sampler())
        layers[2] = saved
        assert eng.kv.length <= 40
        follow = toks[:40] + toks[50:70]
        again = eng.generate(follow, 4, Sampler())
        assert again.stats.reused_tokens > 0
        assert again.tokens == fresh.generate(follow, 4, Sampler()).tokens
    finally:
        eng.close()
        fresh.close()


def test_state_memory_is_allocated_up_front(tiny):
    path, *_ = tiny
    eng = _engine(path, ctx=256)
    try:
        kv = eng.kv
        ptrs = [t.data_ptr() for t in (*kv.conv.values(), *kv.ssm.values())]
        eng.generate(random_tokens(40, eng.cfg.vocab_size), 4, Sampler())
        assert ptrs == [t.data_ptr() for t in (*kv.conv.values(), *kv.ssm.values())]
    finally:
        eng.close()


@pytest.mark.parametrize("chunk", [16, 24, 200])
def test_a_span_mixes_its_deltanet_by_chunks_as_one_call(tiny, chunk):
    """A DeltaNet layer over a span `chunk` tokens at a time carries its states between chunks: the output,
    the final states and the checkpoints cut inside and at the edges of chunks equal those of one call."""
    path, toks, _, _ = tiny
    eng = _engine(path, ubatch=16)
    try:
        layer = next(i for i, r in enumerate(eng.cfg.recurrent) if r)
        mixer = eng.model.layers[layer].mixer
        T = 70
        x = torch.randn(T, eng.cfg.hidden, generator=torch.Generator().manual_seed(3))
        conv0 = torch.randn_like(eng.kv.conv[layer])
        S0 = torch.randn_like(eng.kv.ssm[layer]) * 0.1

        def run(c):
            conv, S = conv0.clone(), S0.clone()
            cuts = [(off, torch.empty_like(conv), torch.empty_like(S)) for off in (16, 37, 48)]
            out = mixer.mix(x, conv, S, cuts, c)
            return out, conv, S, cuts

        out1, conv1, S1, cuts1 = run(None)
        out2, conv2, S2, cuts2 = run(chunk)
        torch.testing.assert_close(out2, out1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(conv2, conv1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(S2, S1, rtol=1e-4, atol=1e-5)
        for (_, c1, s1), (_, c2, s2) in zip(cuts1, cuts2, strict=True):
            torch.testing.assert_close(c2, c1, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s2, s1, rtol=1e-4, atol=1e-5)
    finally:
        eng.close()
