"""Batched steps (MoEModel.step of several sequences): each row bit-identical to its sequence decoded alone, whatever
shares the step, for every architecture, with every expert cached and under a budget that streams; each
step fetches the union of its rows' experts once; and the kernels the batched path runs on several rows at
once compute each row as they would alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moestream.compute import experts as experts_mod
from moestream.compute import linear, native
from moestream.compute.experts import FusedExpert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.formats import quants
from moestream.models import rows as row_ops
from moestream.models.moe import ClampedSwiGLU
from moestream.models.ops import f32_matmul, rms_norm
from moestream.models.routing import route_topk
from tests.hf_gguf import n_experts, one_torch_thread, random_tokens
from tests.test_models import MOE_CASES

pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)

PROMPTS = (3, 9, 17)  # prompt lengths of the three sequences (17: longer than the engine's micro-batch here)
# which sequences decode in each step, in the order given to the step: one joins at step 2, one
# leaves at step 4 and comes back, rows change order
SCHEDULE = [[0, 1], [1, 0], [0, 1, 2], [2, 0, 1], [1, 2], [2, 1], [0, 2, 1]]
CTX = 64


class Stepper:
    """A model's forward over an expert provider that a test may swap (`experts`) and a route hook: a
    sequence alone (`forward`), one token of each of several (`forward_batch`), or blocks of any length
    (`step`)."""

    def __init__(self, model, experts):
        self.model, self.experts, self.route_hook = model, experts, None

    def new_kv(self, ctx: int):
        return self.model.new_kv(ctx)

    def forward(self, tokens: list[int], kv, pos: int) -> torch.Tensor:
        return self.model.forward(tokens, kv, pos, self.experts, route_hook=self.route_hook)

    def step(self, blocks: list[list[int]], kvs: list, positions: list[int]) -> torch.Tensor:
        return self.model.step(blocks, kvs, positions, self.experts, route_hook=self.route_hook)

    def forward_batch(self, tokens: list[int], kvs: list, positions: list[int]) -> torch.Tensor:
        return self.step([[t] for t in tokens], kvs, positions)


class CountingExperts:
    """Wraps the engine's expert provider (every fetch still goes to it) and records each call's ids."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, list[int]]] = []

    def fetch_groups(self, layer, ids, admit=True, ordered=False):
        self.calls.append((layer, list(ids)))
        return self.inner.fetch_groups(layer, ids, admit, ordered)


# the default run's cases (`-m ""` runs every MoE case, float and quantized): the families' kernels and mixers
BATCH_DEFAULT = {("qwen3moe", 0), ("qwen3moe", 1), ("qwen35moe", 1), ("deepseek-v3", 1), ("gpt-oss", 1)}


@pytest.fixture(scope="module", params=[
    pytest.param((a, w), id=f"{a.id}-{'float' if w == 0 else 'quantized'}",
                 marks=[] if (a.id, w) in BATCH_DEFAULT else [pytest.mark.slow])
    for a in MOE_CASES for w in (0, 1)
])  # fmt: skip
def tiny_file(request, tmp_path_factory):
    arch, which = request.param
    model = arch.hf_model(seed=3)
    dense_type, expert_type = arch.stream_types[which]
    path = str(tmp_path_factory.mktemp(arch.id) / "b.gguf")
    if which == 0:
        arch.write(model, path)
    else:
        arch.write(model, path, dense_type=dense_type, expert_type=expert_type)
    return path, model.config


def _decode_alone(model, prompts: list[list[int]], steps: dict[int, int]) -> dict[int, list[torch.Tensor]]:
    """Each sequence prefilled and then greedy-decoded `steps[s]` tokens with forward alone: the logits."""
    out = {}
    for s, prompt in enumerate(prompts):
        kv = model.new_kv(CTX)
        logits = [model.forward(prompt, kv, 0)]
        for j in range(steps[s]):
            logits.append(model.forward([int(logits[-1].argmax())], kv, len(prompt) + j))
        out[s] = logits
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streaming"])
def test_batched_rows_equal_each_sequence_alone(tiny_file, stream):
    path, cfg = tiny_file
    k = cfg.num_experts_per_tok
    slots = k + 3 if stream else cfg.num_hidden_layers * n_experts(cfg)
    eng = Engine(path, EngineOptions(n_slots=slots, ubatch=8, ctx=CTX))
    try:
        model = Stepper(eng.model, eng.cache)
        counting = CountingExperts(model.experts)
        prompts = [random_tokens(n, cfg.vocab_size, seed=n) for n in PROMPTS]
        steps = {s: sum(s in rows for rows in SCHEDULE) for s in range(len(prompts))}
        with torch.inference_mode():
            alone = _decode_alone(model, prompts, steps)
            kvs = [model.new_kv(CTX) for _ in prompts]
            logits = {s: [model.forward(p, kvs[s], 0)] for s, p in enumerate(prompts)}
            assert all(torch.equal(logits[s][0], alone[s][0]) for s in logits)
            model.experts = counting
            for rows in SCHEDULE:
                counting.calls.clear()
                toks = [int(logits[s][-1].argmax()) for s in rows]
                pos = [len(prompts[s]) + len(logits[s]) - 1 for s in rows]
                out = model.forward_batch(toks, [kvs[s] for s in rows], pos)
                assert out.shape == (len(rows), cfg.vocab_size) and out.dtype == torch.float32
                for b, s in enumerate(rows):
                    logits[s].append(out[b])
                    assert kvs[s].length == pos[b] + 1
                # one fetch per layer a step, of the union: no (layer, expert) twice
                layers = [layer for layer, _ in counting.calls]
                assert len(layers) == len(set(layers))
                assert all(len(ids) == len(set(ids)) for _, ids in counting.calls)
                assert max(len(ids) for _, ids in counting.calls) <= len(rows) * k
        for s in range(len(prompts)):
            assert len(logits[s]) == len(alone[s])
            for j, (got, want) in enumerate(zip(logits[s], alone[s], strict=True)):
                assert torch.equal(got, want), (s, j, (got - want).abs().max().item())
        if stream:
            assert eng.cache.used_slots <= slots
    finally:
        eng.close()


def test_one_row_is_forward(tiny_file):
    path, cfg = tiny_file
    eng = Engine(path, EngineOptions(n_slots=64, ctx=CTX))
    try:
        model = Stepper(eng.model, eng.cache)
        prompt = random_tokens(5, cfg.vocab_size)
        kv_a, kv_b = model.new_kv(CTX), model.new_kv(CTX)
        with torch.inference_mode():
            t = int(model.forward(prompt, kv_a, 0).argmax())
            model.forward(prompt, kv_b, 0)
            assert torch.equal(model.forward_batch([t], [kv_a], [5])[0], model.forward([t], kv_b, 5))
            with pytest.raises(ValueError):
                model.forward_batch([t, t], [kv_a, kv_a], [6, 6])
    finally:
        eng.close()


# ---- the kernels the batched path runs on several rows at once --------------------------------------

lane_only = pytest.mark.skipif(not native.lane_ok(), reason="needs AVX-512 VNNI and the native library")


def _rowwise_equal(fn, x: torch.Tensor) -> bool:
    return torch.equal(fn(x), torch.cat([fn(x[b : b + 1]) for b in range(x.shape[0])]))


@lane_only
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_XS, T.Q3_K, T.Q2_K],
                         ids=lambda t: t.name)  # fmt: skip
@pytest.mark.parametrize(("n", "k", "m"), [(64, 256, 2), (96, 768, 7), (33, 2048, 16)])
def test_lane_matmul_rows_are_independent(ggml_type, n, k, m):
    rng = np.random.default_rng(n + k + m)
    lin = linear.from_gguf(quants.random_gguf(ggml_type, n * k, rng), ggml_type, n, k, False)
    assert lin.kind == "lane"
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    assert _rowwise_equal(lin, x)
    assert torch.equal(row_ops.linear_rows(lin, x), torch.cat([lin(x[b : b + 1]) for b in range(m)]))


@lane_only
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_lane_swiglu_rows_are_independent(ggml_type):
    """Several experts with 1..5 rows each in one call: every row as that row alone through one expert."""
    rng = np.random.default_rng(int(ggml_type))
    hidden, ffn = 256, 512
    experts = []
    for _ in range(3):
        gu = linear.from_gguf(quants.random_gguf(ggml_type, 2 * ffn * hidden, rng), ggml_type, 2 * ffn, hidden, False)
        down = linear.from_gguf(quants.random_gguf(ggml_type, hidden * ffn, rng), ggml_type, hidden, ffn, False)
        experts.append(FusedExpert(gu, down))
    xs = [torch.from_numpy(rng.standard_normal((m, hidden)).astype(np.float32)) for m in (1, 5, 3)]
    outs = [torch.empty(x.shape[0], hidden) for x in xs]
    experts_mod.lane_swiglu(experts, xs, outs)
    for e, x, o in zip(experts, xs, outs, strict=True):
        for b in range(x.shape[0]):
            alone = torch.empty(1, hidden)
            experts_mod.lane_swiglu([e], [x[b : b + 1].contiguous()], [alone])
            assert torch.equal(o[b : b + 1], alone)


@lane_only
def test_clamped_swiglu_rows_are_independent():
    """GPT-OSS's experts (MXFP4, biases, clamped activation): every row of a call as that row alone."""
    rng = np.random.default_rng(5)
    hidden, ffn = 256, 352
    experts = []
    for _ in range(3):
        gu = linear.from_gguf(quants.random_gguf(T.MXFP4, 2 * ffn * hidden, rng), T.MXFP4, 2 * ffn, hidden, False)
        down = linear.from_gguf(quants.random_gguf(T.MXFP4, hidden * ffn, rng), T.MXFP4, hidden, ffn, False)
        experts.append(FusedExpert(gu, down))
    biases = [torch.from_numpy(rng.standard_normal((3, rows)).astype(np.float32)) for rows in (ffn, ffn, hidden)]
    act = ClampedSwiGLU(*biases, alpha=1.702, limit=7.0)
    xs = [torch.from_numpy(4 * rng.standard_normal((m, hidden)).astype(np.float32)) for m in (1, 5, 3)]
    outs = [torch.empty(x.shape[0], hidden) for x in xs]
    experts_mod.lane_swiglu(experts, xs, outs, act.lane([0, 1, 2]))
    for e, (expert, x, o) in enumerate(zip(experts, xs, outs, strict=True)):
        for b in range(x.shape[0]):
            alone = torch.empty(1, hidden)
            experts_mod.lane_swiglu([expert], [x[b : b + 1].contiguous()], [alone], act.lane([e]))
            assert torch.equal(o[b : b + 1], alone)


@pytest.mark.parametrize("m", [2, 4, 9])
def test_small_float_ops_rows_are_independent(m):
    """The router's gemv (in chunks of up to 4 rows), the native RMSNorm and the native top-k."""
    torch.manual_seed(m)
    x, w, norm = torch.randn(m, 512), torch.randn(64, 512), torch.rand(512) + 0.5
    assert torch.equal(row_ops.f32_rows(x, w), torch.cat([f32_matmul(x[b : b + 1], w) for b in range(m)]))
    assert torch.equal(
        row_ops.norm_rows(x, norm, 1e-6), torch.cat([rms_norm(x[b : b + 1], norm, 1e-6) for b in range(m)])
    )
    if m <= row_ops.GEMV_ROWS:
        assert _rowwise_equal(lambda r: f32_matmul(r, w), x)
    assert _rowwise_equal(lambda r: rms_norm(r, norm, 1e-6), x)
    logits = torch.randn(m, 64)
    both = route_topk(logits, 8, True)
    for b in range(m):
        one = route_topk(logits[b : b + 1], 8, True)
        assert torch.equal(both[0][b], one[0][0]) and torch.equal(both[1][b], one[1][0])


@pytest.mark.parametrize(("rows", "dim"), [(300, 2048), (3, 40000)])
def test_native_norm_of_a_span_gives_each_row_its_bits_alone(rows, dim):
    """A prompt span's RMSNorm runs on the lane pool in tasks of rows (2048 values: 16 rows a task; 40000: a
    row a task); every row has the bits of a decode step's norm of that row, and torch's values."""
    if native.lib() is None:
        pytest.skip("needs the native library")
    torch.manual_seed(rows)
    x, norm = 3 * torch.randn(rows, dim), torch.rand(dim) + 0.5
    span = rms_norm(x, norm, 1e-6)
    assert torch.equal(span, torch.cat([rms_norm(x[b : b + 1], norm, 1e-6) for b in range(rows)]))
    torch.testing.assert_close(span, torch.nn.functional.rms_norm(x, (dim,), norm, 1e-6), rtol=1e-5, atol=1e-5)


def test_forced_routes_per_row_at_its_own_position(tiny_file):
    """A route hook (--route-trace) answers each row at its own position; rows equal forward alone."""
    path, cfg = tiny_file
    eng = Engine(path, EngineOptions(n_slots=64, ctx=CTX))
    E, k = n_experts(cfg), cfg.num_experts_per_tok
    calls = []

    def hook(layer: int, pos: int, n: int, seq: object = None) -> torch.Tensor:
        calls.append((layer, pos, n))
        return torch.tensor([[(layer + pos + j) % E for j in range(k)]] * n)

    try:
        model = Stepper(eng.model, eng.cache)
        model.route_hook = hook
        prompts = [random_tokens(n, cfg.vocab_size, seed=n) for n in PROMPTS]
        with torch.inference_mode():
            kvs, alone = [model.new_kv(CTX) for _ in prompts], [model.new_kv(CTX) for _ in prompts]
            toks = []
            for p, kv, kv_alone in zip(prompts, kvs, alone, strict=True):
                toks.append(int(model.forward(p, kv, 0).argmax()))
                model.forward(p, kv_alone, 0)
            pos = [len(p) for p in prompts]
            calls.clear()
            out = model.forward_batch(toks, kvs, pos)
            assert {(c[1], c[2]) for c in calls} == {(p, 1) for p in pos}
            for b, p in enumerate(pos):
                assert torch.equal(out[b], model.forward([toks[b]], alone[b], p))
    finally:
        eng.close()


class FailingExperts(CountingExperts):
    """Raises on the fetch of one layer (a read error mid-step)."""

    def __init__(self, inner, fail_layer: int):
        super().__init__(inner)
        self.fail_layer = fail_layer

    def fetch_groups(self, layer, ids, admit=True, ordered=False):
        if layer == self.fail_layer:
            raise OSError("read error")
        return super().fetch_groups(layer, ids, admit, ordered)


def test_failed_step_leaves_each_cache_to_retry(tiny_file):
    """A step that fails part-way leaves every sequence where it was: the retried step equals forward alone."""
    path, cfg = tiny_file
    eng = Engine(path, EngineOptions(n_slots=64, ctx=CTX))
    try:
        model = Stepper(eng.model, eng.cache)
        provider = model.experts
        prompts = [random_tokens(n, cfg.vocab_size, seed=n) for n in PROMPTS]
        with torch.inference_mode():
            kvs, alone = [model.new_kv(CTX) for _ in prompts], [model.new_kv(CTX) for _ in prompts]
            toks = []
            for p, kv, kv_alone in zip(prompts, kvs, alone, strict=True):
                toks.append(int(model.forward(p, kv, 0).argmax()))
                model.forward(p, kv_alone, 0)
            pos = [len(p) for p in prompts]
            model.experts = FailingExperts(provider, fail_layer=1)
            with pytest.raises(OSError):
                model.forward_batch(toks, kvs, pos)
            assert [kv.length for kv in kvs] == pos
            model.experts = provider
            out = model.forward_batch(toks, kvs, pos)
            for b, p in enumerate(pos):
                assert torch.equal(out[b], model.forward([toks[b]], alone[b], p))
    finally:
        eng.close()


# ---- blocks: prompt chunks beside decoding rows in one step ----------------------------------------------

# (tokens already in the cache, block length): a decoding row, a one-token prompt, prompts of 3, 9 (joining at
# position 4: a second chunk) and 17 tokens, and one of 40 (each over the engine's micro-batch of 8 here)
BLOCKS = [(5, 1), (0, 1), (0, 3), (4, 9), (0, 17), (0, 40)]


def _same_cache(a, b) -> bool:
    """Two caches hold the same positions, keys, values and (hybrid caches) recurrent states and checkpoints."""
    sa, sb = a.snapshot(a.length), b.snapshot(b.length)
    if a.length != b.length or len(sa.rows) != len(sb.rows):
        return False
    if not all(torch.equal(x, y) for x, y in zip(sa.rows, sb.rows, strict=True)):
        return False
    if (sa.states is None) != (sb.states is None):
        return False
    for (pa, ca, ha), (pb, cb, hb) in zip(sa.states or [], sb.states or [], strict=True):
        if pa != pb or any(not torch.equal(ca[i], cb[i]) or not torch.equal(ha[i], hb[i]) for i in ca):
            return False
    return True


@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streaming"])
def test_blocks_equal_each_sequence_alone(tiny_file, stream):
    """Blocks of 1..40 tokens (decoding rows and prompt chunks) in one step: each block's logits
    and cache equal forward's of that block alone, and so do the decode steps that follow, every step
    fetching each layer's experts once, for the union."""
    path, cfg = tiny_file
    slots = cfg.num_experts_per_tok + 3 if stream else cfg.num_hidden_layers * n_experts(cfg)
    eng = Engine(path, EngineOptions(n_slots=slots, ubatch=8, ctx=CTX))
    try:
        model = Stepper(eng.model, eng.cache)
        seqs = [random_tokens(pre + n, cfg.vocab_size, seed=10 + j) for j, (pre, n) in enumerate(BLOCKS)]
        with torch.inference_mode():
            alone, kvs = [model.new_kv(CTX) for _ in seqs], [model.new_kv(CTX) for _ in seqs]
            for (pre, _n), s, kv_a, kv in zip(BLOCKS, seqs, alone, kvs, strict=True):
                if pre:
                    model.forward(s[:pre], kv_a, 0)
                    model.forward(s[:pre], kv, 0)
            want = [model.forward(s[pre:], kv_a, pre) for (pre, _), s, kv_a in zip(BLOCKS, seqs, alone, strict=True)]
            counting = CountingExperts(model.experts)
            model.experts = counting
            got = model.step([s[pre:] for (pre, _), s in zip(BLOCKS, seqs, strict=True)], kvs,
                                     [pre for pre, _ in BLOCKS])  # fmt: skip
            model.experts = counting.inner
            assert got.shape == (len(seqs), cfg.vocab_size) and got.dtype == torch.float32
            layers = [layer for layer, _ in counting.calls]
            assert len(layers) == len(set(layers)) and all(len(i) == len(set(i)) for _, i in counting.calls)
            for b in range(len(seqs)):
                assert torch.equal(got[b], want[b]), (b, (got[b] - want[b]).abs().max().item())
                assert _same_cache(kvs[b], alone[b]), b
            pos = [len(s) for s in seqs]
            for _ in range(3):
                toks = [int(g.argmax()) for g in got]
                want = [model.forward([t], kv_a, p) for t, kv_a, p in zip(toks, alone, pos, strict=True)]
                got = model.step([[t] for t in toks], kvs, pos)
                for b in range(len(seqs)):
                    assert torch.equal(got[b], want[b]), b
                pos = [p + 1 for p in pos]
        if stream:
            assert eng.cache.used_slots <= slots
    finally:
        eng.close()


def test_one_block_is_forward(tiny_file):
    """A step of a single prompt block is forward of it (the lone prompt's result, its cache)."""
    path, cfg = tiny_file
    eng = Engine(path, EngineOptions(n_slots=64, ubatch=8, ctx=CTX))
    try:
        model = Stepper(eng.model, eng.cache)
        prompt = random_tokens(21, cfg.vocab_size, seed=5)
        kv_a, kv_b = model.new_kv(CTX), model.new_kv(CTX)
        with torch.inference_mode():
            assert torch.equal(model.step([prompt], [kv_a], [0])[0], model.forward(prompt, kv_b, 0))
            assert _same_cache(kv_a, kv_b)
            with pytest.raises(ValueError):
                model.step([prompt, []], [kv_a, kv_b], [21, 21])
    finally:
        eng.close()


@lane_only
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [17, 130, 600])
def test_lane_matmul_prompt_rows_are_independent(ggml_type, m):
    """A prompt block's hundreds of rows through the lane matmul: each row as it is alone and in a call of
    any other rows."""
    rng = np.random.default_rng(m)
    n, k = 48, 512
    lin = linear.from_gguf(quants.random_gguf(ggml_type, n * k, rng), ggml_type, n, k, False)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = lin(x)
    for b in range(0, m, 7):
        assert torch.equal(y[b : b + 1], lin(x[b : b + 1])), b
    assert torch.equal(y[m // 3 :], lin(x[m // 3 :]))


@lane_only
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_lane_swiglu_prompt_rows_are_independent(ggml_type):
    """Experts with many rows each (a prompt block's, joined by decoding rows; over SWIGLU_MAX_ROWS in all,
    so the call splits): every row as it is alone, and as in a call of only its own block's rows."""
    rng = np.random.default_rng(int(ggml_type) + 1)
    hidden, ffn = 256, 256
    experts = []
    for _ in range(3):
        gu = linear.from_gguf(quants.random_gguf(ggml_type, 2 * ffn * hidden, rng), ggml_type, 2 * ffn, hidden, False)
        down = linear.from_gguf(quants.random_gguf(ggml_type, hidden * ffn, rng), ggml_type, hidden, ffn, False)
        experts.append(FusedExpert(gu, down))
    ms = (700, 1, 450)
    xs = [torch.from_numpy(rng.standard_normal((m, hidden)).astype(np.float32)) for m in ms]
    outs = [torch.empty(x.shape[0], hidden) for x in xs]
    experts_mod.lane_swiglu(experts, xs, outs)
    for e, x, o in zip(experts, xs, outs, strict=True):
        part = torch.empty(x.shape[0] - x.shape[0] // 2, hidden)
        experts_mod.lane_swiglu([e], [x[x.shape[0] // 2 :].contiguous()], [part])
        assert torch.equal(o[x.shape[0] // 2 :], part)
        for b in range(0, x.shape[0], 53):
            alone = torch.empty(1, hidden)
            experts_mod.lane_swiglu([e], [x[b : b + 1].contiguous()], [alone])
            assert torch.equal(o[b : b + 1], alone)
