"""The lane-layout kernels (native/qmm_vnni.c or qmm_avx2.c, packed by lane_pack.c) against the gguf reference decoder
and a numpy model of the int8 activation quantization they apply."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from moestream.compute import experts as experts_mod
from moestream.compute import linear, native
from moestream.compute.experts import FusedExpert
from moestream.errors import ComputeError
from moestream.formats import quants
from moestream.models.moe import ClampedSwiGLU
from moestream.paths import cache_dir

pytestmark = pytest.mark.skipif(not native.lane_ok(), reason="needs the lane kernels (AVX-512 VNNI or AVX2)")
PER32_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.MXFP4]  # scales per 32 weights: rows of any multiple of 32
LANE_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.Q3_K, T.Q2_K, *PER32_TYPES]


def reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> np.ndarray:
    return np.asarray(gq.dequantize(raw.reshape(shape[0], -1), T(ggml_type)), dtype=np.float32).reshape(shape)


def q8_activations(x: np.ndarray) -> np.ndarray:
    """What the kernel multiplies: x rounded to int8 with one scale (max |x| / 127) per 32 values."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(x.shape)


@pytest.mark.parametrize("ggml_type", LANE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k", "m"), [(64, 256, 1), (96, 768, 1), (33, 2048, 3), (128, 512, 9)])
def test_matmul_is_the_quantized_product(ggml_type, n, k, m):
    rng = np.random.default_rng(n * k + m)
    raw = quants.random_gguf(ggml_type, n * k, rng)
    w = reference(raw, ggml_type, (n, k))
    lin = linear.from_gguf(raw, ggml_type, n, k, False)
    assert lin.kind == "lane"
    # the layout is a reshuffle: dense() gives the reference weights back
    np.testing.assert_allclose(lin.dense().numpy(), w, rtol=1e-6, atol=1e-7 * np.abs(w).max())
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = lin(torch.from_numpy(x)).numpy()
    want = q8_activations(x).astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # and against the unquantized product, the error is activation rounding only (~0.5%; up to 1% for a
    # single 256-wide row of random Q5_K, whose large common offsets cancel in the product)
    exact = x @ w.T
    assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 2e-2


@pytest.mark.parametrize("ggml_type", PER32_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k"), [(37, 1408), (64, 352), (3, 32), (5, 2880), (16, 1024)])
def test_rows_of_any_multiple_of_32(ggml_type, n, k):
    """DeepSeek-V2-Lite's 1408-wide ffn_down (Q5_0 in a Q4_K_M file) and GPT-OSS's 2880-wide MXFP4 experts: a
    row's last group holds 1..15 lanes and is read masked. The product is the quantized one for m = 1, 2, 5, 16
    rows, each row the same bits as computed alone."""
    rng = np.random.default_rng(n * k)
    raw = quants.random_gguf(ggml_type, n * k, rng)
    w = reference(raw, ggml_type, (n, k))
    lin = linear.from_gguf(raw, ggml_type, n, k, False)
    assert lin.kind == "lane" and lin.nbytes == quants.tensor_nbytes(ggml_type, n * k)  # as the GGUF blocks
    np.testing.assert_array_equal(lin.dense().numpy().view(np.uint32), w.view(np.uint32))
    for m in (1, 2, 5, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = lin(torch.from_numpy(x)).numpy()
        want = q8_activations(x).astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        for i in range(m):
            np.testing.assert_array_equal(lin(torch.from_numpy(x[i : i + 1])).numpy()[0], y[i])


@pytest.mark.parametrize("ggml_type", LANE_TYPES, ids=lambda t: t.name)
def test_each_row_is_computed_alone(ggml_type):
    """Batched decode relies on it: a row's result has the same bits whatever the other rows of the call
    (the one-token kernel, two weight rows at a time, and the many-token one agree bit for bit)."""
    n, k = 67, 1280
    rng = np.random.default_rng(int(ggml_type))
    lin = linear.from_gguf(quants.random_gguf(ggml_type, n * k, rng), ggml_type, n, k, False)
    x = torch.from_numpy(rng.standard_normal((16, k)).astype(np.float32))
    alone = torch.cat([lin(x[i : i + 1]) for i in range(16)])
    for m in (2, 5, 16):
        assert torch.equal(lin(x[:m]), alone[:m])


@pytest.mark.parametrize("ggml_type", LANE_TYPES, ids=lambda t: t.name)
def test_rows_alone_at_the_tile_edges(ggml_type):
    """The many-token kernel works in tiles of weight rows x tokens and in blocks of tokens (a block of 8
    tokens at k = 2048): an odd n leaves a last row alone, m = 3, 5..7 leave partial tiles, 9 and 17 cross the
    blocks; 768 ends rows in a group of 8 lanes (two tokens a register), and the per-32 types' 1408 and 2880 in a
    masked group of 12 and 10 lanes. Every row has the bits it has alone."""
    rng = np.random.default_rng(int(ggml_type) + 7)
    shapes = [(37, 2048), (9, 768)] + ([(5, 1408), (3, 2880)] if ggml_type in PER32_TYPES else [])
    for n, k in shapes:
        lin = linear.from_gguf(quants.random_gguf(ggml_type, n * k, rng), ggml_type, n, k, False)
        x = torch.from_numpy(rng.standard_normal((17, k)).astype(np.float32))
        alone = torch.cat([lin(x[i : i + 1]) for i in range(17)])
        for m in (2, 3, 5, 6, 7, 9, 17):
            assert torch.equal(lin(x[17 - m :]), alone[17 - m :]), (n, k, m)


@pytest.mark.parametrize("ggml_type", PER32_TYPES, ids=lambda t: t.name)
def test_fallback_agrees_with_the_lane_kernels(ggml_type, monkeypatch):
    """Without VNNI (here: switched off) these types are widened to bf16 by the C decoder, not numpy: the
    slow-path note does not name them, and the two forms give the same product within rounding."""
    n, k = 48, 1408
    rng = np.random.default_rng(3)
    raw = quants.random_gguf(ggml_type, n * k, rng)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    lane = linear.from_gguf(raw, ggml_type, n, k, False)
    assert lane.kind == "lane" and not linear.slow_path(ggml_type, n, k, False)
    monkeypatch.setattr(native, "lane_ok", lambda: False)
    wide = linear.from_gguf(raw, ggml_type, n, k, False)
    assert wide.kind == "bf16" and not linear.slow_path(ggml_type, n, k, False)
    assert linear.packed_nbytes(ggml_type, n, k, False) == n * k * 2
    w = reference(raw, ggml_type, (n, k))
    torch.testing.assert_close(wide.dense(), torch.from_numpy(w).to(torch.bfloat16).float(), rtol=0, atol=0)
    a, b = lane(x), wide(x)
    assert float(torch.linalg.norm(a - b) / torch.linalg.norm(b)) < 2e-2


def test_scalar_build_decodes_mxfp4_as_gguf():
    """The portable C decoder (no F16C, no AVX) of the fallback path, every byte value in every position."""
    lib = native.lib(("-DMS_SCALAR",))
    b = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 17))
    b = (b + np.arange(17, dtype=np.uint8) * 37).astype(np.uint8).reshape(-1)
    out = np.zeros(256 * 32, np.float32)
    assert lib.ms_dequant(int(T.MXFP4), b.ctypes.data, out.size, out.ctypes.data, 0) == 0
    with np.errstate(over="ignore"):  # e = 255 times 12 is inf, in both
        want = reference(b, T.MXFP4, (256, 32)).reshape(-1)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_sizes_match_the_gguf_blocks():
    # as their GGUF blocks but for Q4_K's and Q5_K's d/dmin pairs (one per 256 weights, stored per 8 lanes)
    per_256 = (
        (T.Q4_0, 144),
        (T.Q8_0, 272),
        (T.Q4_K, 148),
        (T.Q5_K, 180),
        (T.Q6_K, 210),
        (T.IQ4_XS, 138),
        (T.Q3_K, 114),
        (T.Q2_K, 84),
        (T.Q5_0, 176),
        (T.Q5_1, 192),
        (T.Q4_1, 160),
        (T.MXFP4, 136),
    )
    for t, per_row in ((t, 2048 // 256 * b) for t, b in per_256):
        assert linear.compute_kind(t, 768, 2048, False) == "lane"
        assert linear.packed_nbytes(t, 768, 2048, False) == 768 * per_row
        assert native.lib().ms_lane_row_bytes(int(t), 2048) == per_row
    assert linear.compute_kind(T.Q5_K, 64, 768, False) == "lane"
    assert linear.compute_kind(T.Q4_0, 64, 96, False) == "lane"  # per-32 types: rows of 32-blocks
    assert linear.compute_kind(T.Q4_1, 64, 96, False) == "lane"
    assert linear.compute_kind(T.Q5_0, 2048, 1408, False) == "lane"
    assert linear.compute_kind(T.Q8_0, 2048, 1408, False) == "lane"


def test_results_do_not_depend_on_thread_count():
    n, k = 512, 2048
    raw = quants.random_gguf(T.Q4_K, n * k, np.random.default_rng(5))
    lin = linear.from_gguf(raw, T.Q4_K, n, k, False)
    x = torch.randn(5, k)
    before = native.set_threads(1)
    try:
        one = lin(x)
        native.set_threads(2)
        assert torch.equal(one, lin(x))  # each output row is computed whole by one thread
    finally:
        native.set_threads(before)


def test_concat_stacks_rows():
    k = 512
    parts = [linear.from_gguf(quants.random_gguf(T.Q8_0, n * k, np.random.default_rng(n)), T.Q8_0, n, k, False)
             for n in (64, 8, 24)]  # fmt: skip
    both = linear.concat(parts)
    assert both is not None and both.kind == "lane" and both.out_features == 96
    x = torch.randn(2, k)
    assert torch.equal(both(x), torch.cat([p(x) for p in parts], dim=1))
    mixed = linear.from_gguf(quants.random_gguf(T.Q4_0, 64 * k, np.random.default_rng(0)), T.Q4_0, 64, k, False)
    assert linear.concat([parts[0], mixed]) is None  # one kernel per type


@pytest.mark.parametrize(
    ("gu_type", "down_type", "f"),
    [(T.Q4_K, t, 256) for t in (T.Q4_0, T.Q8_0, T.Q5_K, T.Q6_K, T.IQ4_XS, T.Q3_K, T.Q2_K, *PER32_TYPES)]
    + [(T.Q4_K, T.Q5_0, 352), (T.Q4_K, T.Q5_1, 352), (T.MXFP4, T.MXFP4, 352)],  # a width of 11 lanes
    ids=lambda v: v.name if isinstance(v, T) else str(v),
)
def test_swiglu_group_equals_expert_by_expert(gu_type, down_type, f):
    h = 512
    rng = np.random.default_rng(7)
    experts, refs = [], []
    for _ in range(3):
        gu = quants.random_gguf(gu_type, 2 * f * h, rng)
        dn = quants.random_gguf(down_type, h * f, rng)
        gate_up = linear.from_gguf(gu, gu_type, 2 * f, h, False)
        down = linear.from_gguf(dn, down_type, h, f, False)
        experts.append(FusedExpert(gate_up, down))
        refs.append((gate_up, down))
    counts = [2, 0, 3]
    x = torch.randn(sum(counts), h)
    y = torch.full_like(x, float("nan"))
    r0s = [0, 2, 2]
    experts_mod.lane_swiglu(experts, [x[r : r + c] for r, c in zip(r0s, counts, strict=True)],
                       [y[r : r + c] for r, c in zip(r0s, counts, strict=True)])  # fmt: skip
    r0 = 0
    for (gate_up, down), c in zip(refs, counts, strict=True):
        xe = x[r0 : r0 + c]
        a, b = gate_up(xe).chunk(2, dim=-1)
        want = down(torch.nn.functional.silu(a) * b)
        scale = float(want.abs().max()) if c else 1.0
        torch.testing.assert_close(y[r0 : r0 + c], want, rtol=1e-5, atol=1e-5 * scale)
        r0 += c


def _clamped_experts(rng, h: int, f: int, n: int) -> tuple[list, ClampedSwiGLU]:
    """n MXFP4 experts (gate/up fused) and GPT-OSS's activation with random biases for them."""
    experts = []
    for _ in range(n):
        gu = linear.from_gguf(quants.random_gguf(T.MXFP4, 2 * f * h, rng), T.MXFP4, 2 * f, h, False)
        down = linear.from_gguf(quants.random_gguf(T.MXFP4, h * f, rng), T.MXFP4, h, f, False)
        experts.append(FusedExpert(gu, down))
    biases = [torch.from_numpy(rng.standard_normal((n, rows)).astype(np.float32)) for rows in (f, f, h)]
    return experts, ClampedSwiGLU(*biases, alpha=1.702, limit=7.0)


@pytest.mark.parametrize("f", [352, 2880])  # 2880: GPT-OSS's width (90 blocks: a last group of 10 lanes)
def test_clamped_swiglu_group_equals_torch_path(f):
    """GPT-OSS's experts in one native call (biases and the clamped activation in C) equal ClampedSwiGLU's
    torch path over the same lane matmuls, with inputs large enough that both clamps bite."""
    h = 256
    rng = np.random.default_rng(f)
    experts, ffn = _clamped_experts(rng, h, f, 3)
    counts = [2, 0, 3]
    x = torch.from_numpy(rng.standard_normal((sum(counts), h)).astype(np.float32)) * 4
    y = torch.full_like(x, float("nan"))
    spans = [(0, 2), (2, 2), (2, 5)]
    ids = [0, 1, 2]
    experts_mod.lane_swiglu(experts, [x[a:b] for a, b in spans], [y[a:b] for a, b in spans], ffn.lane(ids))
    clamped = 0
    for e, (a, b) in zip(ids, spans, strict=True):
        if a == b:
            continue
        gate, up = experts[e].fused(x[a:b]).chunk(2, dim=-1)
        clamped += int((gate + ffn.gate_bias[e] > 7).sum() + ((up + ffn.up_bias[e]).abs() > 7).sum())
        want = ffn(e, experts[e], x[a:b])
        torch.testing.assert_close(y[a:b], want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert clamped > 0


def test_clamped_swiglu_refuses_bad_biases():
    h, f = 256, 352
    experts, ffn = _clamped_experts(np.random.default_rng(0), h, f, 2)
    x, y = torch.randn(1, h), torch.empty(1, h)
    with pytest.raises(ComputeError, match="bias triples"):
        experts_mod.lane_swiglu(experts, [x, x], [y, y], ffn.lane([0]))
    bad = experts_mod.ClampedAct([(ffn.gate_bias[0], ffn.up_bias[0][:-32], ffn.down_bias[0])], 1.702, 7.0)
    with pytest.raises(ComputeError, match="bias"):
        experts_mod.lane_swiglu(experts[:1], [x], [y], bad)
    bad = experts_mod.ClampedAct([(ffn.gate_bias[0], ffn.up_bias[0], ffn.down_bias[0].double())], 1.702, 7.0)
    with pytest.raises(ComputeError, match="bias"):
        experts_mod.lane_swiglu(experts[:1], [x], [y], bad)


@pytest.mark.parametrize("clamped", [False, True], ids=["swiglu", "clamped"])
def test_swiglu_reading_rows_in_place_equals_the_copied_rows(clamped):
    """RowsOf (each expert's rows copied from x quantized once) gives the bits of the copied inputs, rows
    repeated and out of order included; an index outside x is refused, not read."""
    h, f = 256, 352 if clamped else 512
    rng = np.random.default_rng(3)
    if clamped:
        experts, ffn = _clamped_experts(rng, h, f, 3)
        act = ffn.lane([0, 1, 2])
    else:
        experts = [FusedExpert(linear.from_gguf(quants.random_gguf(T.Q4_K, 2 * f * h, rng), T.Q4_K, 2 * f, h, False),
                               linear.from_gguf(quants.random_gguf(T.Q6_K, h * f, rng), T.Q6_K, h, f, False))
                   for _ in range(3)]  # fmt: skip
        act = None
    x = torch.randn(6, h)
    rows = [np.array([4, 0, 4]), np.array([], np.int64), np.array([5, 1])]
    want = [torch.empty(len(r), h) for r in rows]
    experts_mod.lane_swiglu(experts, [x[torch.from_numpy(r)].contiguous() for r in rows], want, act)
    got = [torch.full((len(r), h), float("nan")) for r in rows]
    prepared = experts_mod.PreparedRows(x)
    experts_mod.lane_swiglu(experts, experts_mod.RowsOf(prepared, rows), got, act)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    with pytest.raises(ComputeError):
        experts_mod.lane_swiglu(experts, experts_mod.RowsOf(prepared, [np.array([6, 0, 1]), *rows[1:]]), got, act)


def test_scalar_build_reports_no_lane_kernels():
    lib = native.lib(("-DMS_SCALAR",))
    assert lib is not None and lib.ms_lane_supported() == 0
    y = np.zeros(4, np.float32)
    x = np.zeros(256, np.float32)
    w = np.zeros(4 * 144, np.uint8)
    with pytest.raises(ComputeError, match="no lane kernels"):  # callers check lane_ok() first
        lib.ms_qmm(2, w.ctypes.data, 4, 256, x.ctypes.data, 1, 256, y.ctypes.data, 4)


def test_the_library_reports_the_kernels_this_cpu_builds():
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags)
    assert native.lane_isa() == ("avx512-vnni" if vnni else "avx2")


def test_bad_shapes_are_refused():
    lib = native.lib()
    for t, k in (
        (T.Q4_0, 80),
        (T.Q4_1, 48),
        (T.IQ2_XXS, 256),
        (T.Q4_K, 1408),
        (T.Q5_0, 48),
        (T.Q6_K, 384),
        (T.Q4_K, 0),
        (T.Q4_K, -256),
    ):
        with pytest.raises(ComputeError, match="ms_lane_row_bytes"):
            lib.ms_lane_row_bytes(int(t), k)
    with pytest.raises(ComputeError, match="unsupported weight type"):
        lib.ms_lane_pack(int(T.IQ2_XXS), ctypes.c_void_p(0), 1, 256, ctypes.c_void_p(0))
    with pytest.raises(ComputeError, match="null or misaligned"):
        lib.ms_lane_pack(int(T.Q4_K), ctypes.c_void_p(0), 1, 256, ctypes.c_void_p(0))
    with pytest.raises(ComputeError, match="sizes or counts"):
        lib.ms_lane_pack(int(T.Q4_K), ctypes.c_void_p(0), 0, 256, ctypes.c_void_p(0))


@pytest.mark.parametrize("count", [1, 2, 10])
def test_packing_many_segments_at_once_equals_one_by_one(count):
    rng = np.random.default_rng(count)
    lib = native.lib()
    shapes = [(T.Q4_0, 96, 512), (T.Q6_K, 33, 768), (T.Q8_0, 64, 256), (T.Q5_K, 128, 2048), (T.Q4_K, 7, 256),
              (T.IQ4_XS, 40, 768), (T.Q3_K, 9, 512), (T.Q2_K, 24, 1280), (T.Q5_0, 11, 1408), (T.MXFP4, 5, 2880)
              ][:count]  # fmt: skip
    raws = [quants.random_gguf(t, n * k, rng) for t, n, k in shapes]
    sizes = [n * lib.ms_lane_row_bytes(int(t), k) for t, n, k in shapes]
    one = [np.zeros(sz, np.uint8) for sz in sizes]
    for (t, n, k), raw, out in zip(shapes, raws, one, strict=True):
        assert lib.ms_lane_pack(int(t), raw.ctypes.data, n, k, out.ctypes.data) == 0
    many = [np.full(sz, 0xAB, np.uint8) for sz in sizes]
    arrays = [
        np.array([int(t) for t, _, _ in shapes], np.int32),
        np.array([r.ctypes.data for r in raws], np.uint64),
        np.array([n for _, n, _ in shapes], np.int64),
        np.array([k for _, _, k in shapes], np.int64),
        np.array([m.ctypes.data for m in many], np.uint64),
    ]
    assert lib.ms_lane_pack_many(count, *(a.ctypes.data for a in arrays)) == 0
    for a, b in zip(one, many, strict=True):
        np.testing.assert_array_equal(a, b)
    arrays[0][0] = int(T.IQ2_XXS)  # no lane form: refused before anything is written
    with pytest.raises(ComputeError, match="ms_lane_pack_many"):
        lib.ms_lane_pack_many(count, *(a.ctypes.data for a in arrays))
    assert lib.ms_lane_pack_many(0, *(a.ctypes.data for a in arrays)) == 0  # nothing to do


def test_q4_k_m_model_computes_its_q6_k_experts_in_lane_form(tmp_path):
    """llama.cpp's Q4_K_M keeps ffn_down in Q6_K on some layers: those experts take lane slots (not bf16 ones,
    over twice the bytes), and the output does not depend on the budget."""
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from moestream.engine.sampling import Sampler
    from moestream.synth.shapes import use_more_bits, write_synth

    path = write_synth("tiny", "Q4_K_M", tmp_path / "m.gguf", progress=False)
    prompt = list(range(5, 45))
    outs = []
    for n_slots in (64, 8):
        eng = Engine(path, EngineOptions(n_slots=n_slots))
        try:
            outs.append(eng.generate(prompt, 8, Sampler()).tokens)
            n_layers = eng.cfg.n_layers
            six = [lay for lay in range(n_layers) if use_more_bits(lay, n_layers)]
            assert six and len(six) < n_layers
            for layer in range(n_layers):
                down = next(eng.cache.fetch(layer, [0]))[1].down
                assert down.kind == "lane"
                assert down.ggml_type == (T.Q6_K if layer in six else T.Q4_K)
            h, f = down.out_features, down.in_features
            assert eng.store.slot_nbytes < 2 * f * h * 148 // 256 + h * f * 210 // 256 + 4096 + 3 * 64
        finally:
            eng.close()
    assert outs[0] == outs[1]


def test_v2_lite_style_model_computes_its_q5_0_downs_in_lane_form(tmp_path, monkeypatch):
    """llama.cpp's Q4_K_M writes a DeepSeek-V2-Lite-style expert down (rows of 128 here, 1408 in the real one:
    not whole 256-groups) as Q5_0, or Q8_0 on the layers given more bits. Those experts now take slots of their
    GGUF size instead of widened bf16 ones, and give the greedy tokens and (up to activation rounding) the
    logits of the widened form, streamed or not."""
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from moestream.engine.sampling import Sampler
    from moestream.synth.shapes import write_synth

    path = write_synth("tiny-deepseek2", "Q4_K_M", tmp_path / "m.gguf", progress=False)
    prompt = list(range(20, 60))

    def run(n_slots: int) -> tuple[torch.Tensor, list[int], int, str]:
        eng = Engine(path, EngineOptions(n_slots=n_slots, threads=1))
        try:
            # most layers' downs are Q5_0 (Q4_K's fallback), some Q8_0 (Q6_K's, on the layers given more bits)
            five = [i for i, lay in enumerate(eng.store.layouts) if lay.down[0] == T.Q5_0]
            assert five and all(eng.store.layouts[i].down[2] % 256 for i in five)
            with torch.inference_mode():
                logits = eng.forward(prompt, 0, all_logits=True)
            eng.kv.truncate(0)
            down = next(eng.cache.fetch(five[0], [0]))[1].down
            return logits, eng.generate(prompt, 8, Sampler()).tokens, eng.store.slot_nbytes, down.kind
        finally:
            eng.close()

    l_lane, t_lane, slot_lane, kind = run(64)
    assert kind == "lane"
    l_stream, t_stream, _, _ = run(6)
    with monkeypatch.context() as mp:  # as before these kernels: Q5_0 rows of 128 widened to bf16
        mp.setattr(linear, "LANE_K_PER32", frozenset())
        l_wide, t_wide, slot_wide, kind = run(64)
    assert kind == "bf16"
    assert t_lane == t_wide == t_stream
    torch.testing.assert_close(l_stream, l_lane, rtol=0, atol=0)
    per_position = (l_lane - l_wide).norm(dim=-1) / l_wide.norm(dim=-1)
    assert float(per_position.max()) < 2e-2
    h, f = 256, 128
    # slots are sized for the largest expert: a Q8_0 down's
    assert slot_lane == -(-(2 * f * h * 148 // 256 + h * f * 34 // 32 + 3 * 64) // 4096) * 4096 < slot_wide


def extreme_blocks(ggml_type: int, n_blocks: int) -> np.ndarray:
    """GGUF blocks whose weights all take the code farthest from zero that the kernels multiply unsigned (or
    |w| = 128 for the types they multiply as |w| x sign(w) x), scales 1: the int16 pair sums of AVX2's vpmaddubsw,
    and the int16 sums of two chunks' pairs (Q5, Q6_K), are then at their largest."""
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if ggml_type == T.Q8_0:  # d, then 32 codes -128
        block = np.concatenate([one, np.full(32, 0x80, np.uint8)])
    elif ggml_type == T.Q4_0:  # d, then nibbles 15
        block = np.concatenate([one, np.full(16, 0xFF, np.uint8)])
    elif ggml_type == T.Q4_1:  # d, m 0, then nibbles 15
        block = np.concatenate([one, np.zeros(2, np.uint8), np.full(16, 0xFF, np.uint8)])
    elif ggml_type == T.Q4_K:  # d, dmin 0, scales and mins 63, nibbles 15
        block = np.concatenate([one, np.zeros(2, np.uint8), np.full(12, 0xFF, np.uint8), np.full(128, 0xFF, np.uint8)])
    elif ggml_type == T.Q5_0:  # d, high bits and nibbles all set (code 31)
        block = np.concatenate([one, np.full(4 + 16, 0xFF, np.uint8)])
    elif ggml_type == T.Q5_K:  # d, dmin 0, scales and mins 63, codes 31
        block = np.concatenate([one, np.zeros(2, np.uint8), np.full(12 + 32 + 128, 0xFF, np.uint8)])
    elif ggml_type == T.Q6_K:  # codes 63, scales 1, d
        block = np.concatenate([np.full(128 + 64, 0xFF, np.uint8), np.ones(16, np.uint8), one])
    elif ggml_type == T.IQ4_XS:  # d, scales -32, nibbles 0 (value -127)
        block = np.concatenate([one, np.zeros(2 + 4 + 128, np.uint8)])
    else:  # MXFP4: exponent 2^0, nibbles 7 (value 6, doubled 12)
        block = np.concatenate([np.array([127], np.uint8), np.full(16, 0x77, np.uint8)])
    return np.tile(block, n_blocks)


@pytest.mark.parametrize(
    "ggml_type", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_K, T.Q6_K, T.IQ4_XS, T.MXFP4], ids=lambda t: t.name
)
def test_the_largest_products_do_not_saturate(ggml_type):
    n, k = 8, 1024
    raw = extreme_blocks(ggml_type, n * k // GGML_QUANT_SIZES[ggml_type][0])
    w = reference(raw, ggml_type, (n, k))
    lin = linear.from_gguf(raw, ggml_type, n, k, False)
    assert lin.kind == "lane"
    x = np.stack([np.ones(k), -np.ones(k), np.where(np.arange(k) % 2, 1.0, -1.0)]).astype(np.float32)
    want = q8_activations(x).astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(lin(torch.from_numpy(x)).numpy(), want, rtol=1e-6)
    for i in range(len(x)):  # the one-token kernel
        np.testing.assert_allclose(lin(torch.from_numpy(x[i : i + 1])).numpy()[0], want[i], rtol=1e-6)


@pytest.fixture(scope="module")
def other_tile_build():
    """This CPU's library with the one-sum types' other tile shape: 1 x 8 where the loader takes 2 x 4, and back."""
    wide = "-DMS_ONE_SUM_TOKENS=8" in native.cpu_tuning()
    flags = (*native.BASE_FLAGS, "-march=native", f"-DMS_ONE_SUM_TOKENS={4 if wide else 8}")
    return native.load_library(native.build_library(flags, cache_dir()))


@pytest.mark.skipif(native.lane_isa() != "avx512-vnni", reason="the tile shapes are the VNNI kernels'")
@pytest.mark.parametrize("ggml_type", LANE_TYPES, ids=lambda t: t.name)
def test_both_tile_shapes_give_the_same_bits(ggml_type, other_tile_build):
    """The tile shape is a CPU's tuning: 1 x 8 and 2 x 4 tiles give every product the same bits, at whole and
    partial tiles and blocks (m up to 33), odd row counts, and groups of 8 (768) and of 12 lanes (1408)."""
    rng = np.random.default_rng(int(ggml_type) + 11)
    shapes = [(37, 2048), (9, 768)] + ([(5, 1408)] if ggml_type in PER32_TYPES else [])
    for n, k in shapes:
        lin = linear.from_gguf(quants.random_gguf(ggml_type, n * k, rng), ggml_type, n, k, False)
        for m in (1, 2, 3, 7, 8, 9, 12, 17, 33):
            x = rng.standard_normal((m, k)).astype(np.float32)
            want = lin(torch.from_numpy(x)).numpy()
            got = np.empty((m, n), np.float32)
            w = lin.weight.data_ptr()
            other_tile_build.ms_qmm(int(ggml_type), w, n, k, x.ctypes.data, m, k, got.ctypes.data, n)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{n}x{k}, m={m}")


@pytest.fixture(scope="module")
def avx2_build():
    """This CPU's library built without AVX-512: the AVX2 lane kernels."""
    flags = (*native.BASE_FLAGS, "-march=native", "-mno-avx512f")
    library = native.load_library(native.build_library(flags, cache_dir()))
    assert native.lane_isa(library) == "avx2"
    return library


@pytest.mark.skipif(native.lane_isa() != "avx512-vnni", reason="compares the AVX2 kernels with the VNNI ones")
@pytest.mark.parametrize("ggml_type", LANE_TYPES, ids=lambda t: t.name)
def test_avx2_kernels_give_the_vnni_bits(ggml_type, avx2_build):
    """qmm_avx2.c takes qmm_vnni.c's steps on half groups: on one CPU both builds give every product the same bits."""
    rng = np.random.default_rng(int(ggml_type))
    shapes = [(33, 2048, 1), (40, 768, 9), (17, 256, 5)] + ([(24, 352, 6)] if ggml_type in PER32_TYPES else [])
    for n, k, m in shapes:
        lin = linear.from_gguf(quants.random_gguf(ggml_type, n * k, rng), ggml_type, n, k, False)
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = lin(torch.from_numpy(x)).numpy()
        got = np.empty((m, n), np.float32)
        avx2_build.ms_qmm(int(ggml_type), lin.weight.data_ptr(), n, k, x.ctypes.data, m, k, got.ctypes.data, n)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
