"""QLinear against x @ W.T with W from gguf's reference decoder; the C kernels against the torch path."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.compute import kernels, linear, native
from moestream.errors import ComputeError, ModelFileError
from moestream.formats import quants

ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]

random_gguf = quants.random_gguf


def reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> np.ndarray:
    return np.asarray(gq.dequantize(raw.reshape(shape[0], -1), T(ggml_type)), dtype=np.float32).reshape(shape)


needs_native = pytest.mark.skipif(native.lib() is None, reason="native library unavailable")


KV_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}  # the C side's kv_type codes


@pytest.fixture
def no_lane(monkeypatch):
    """The torch int4 / bf16 forms, as on a CPU without AVX-512 VNNI."""
    monkeypatch.setattr(native, "_lane_ok", False)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_qlinear_matches_reference(ggml_type, exact):
    n, k = 128, 512
    raw = random_gguf(ggml_type, n * k, np.random.default_rng(int(ggml_type)))
    w = torch.from_numpy(reference(raw, ggml_type, (n, k)))
    x = torch.randn(2, 3, k)
    ref = x @ w.T
    lin = linear.from_gguf(raw, ggml_type, n, k, exact)
    assert (lin.out_features, lin.in_features) == (n, k)
    assert lin.kind == linear.compute_kind(ggml_type, n, k, exact)
    assert lin.nbytes == linear.packed_nbytes(ggml_type, n, k, exact)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (2, 3, n)
    if lin.kind == "f32":
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    else:
        # lane: int8 activations (tests/test_lane.py checks that product exactly); others: bf16 rounding
        assert rel_err(y, ref) < (2e-2 if lin.kind == "lane" else 1e-2)
        # bf16 rounding of the weights alone, seen through dense(), stays well inside that
        assert rel_err(lin.dense(), w) < 1e-2
        if lin.kind == "int4":
            torch.testing.assert_close(lin.dense(), _eye_dense(lin), rtol=0, atol=0)


@pytest.mark.skipif(not native.lane_ok(), reason="needs the lane kernels (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("ggml_type", [T.Q5_0, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_grouped_products_equal_each_groups_own(ggml_type):
    """qmm_groups (the per-head up-projections of latent attention): group g's rows times its own inputs, the
    same bits as a matmul of those rows alone."""
    groups, n, k = 6, 40, 512 if ggml_type == T.Q4_K else 192
    raw = random_gguf(ggml_type, groups * n * k, np.random.default_rng(7))
    lin = linear.from_gguf(raw, ggml_type, groups * n, k, False)
    assert lin.kind == "lane"
    x = torch.randn(3, groups, k).transpose(0, 1)  # [G, M, K], not contiguous: as the heads arrive
    y = kernels.qmm_groups(lin.weight, lin.ggml_type, lin.out_features, x)
    assert y.shape == (groups, 3, n)
    for g in range(groups):
        part = linear.QLinear(n, k, "lane", lin.weight[g * n : (g + 1) * n], ggml_type=int(ggml_type))
        assert torch.equal(y[g], part.mm(x[g].contiguous()))
    with pytest.raises(ComputeError):  # rows not a whole number of groups
        kernels.qmm_groups(lin.weight, lin.ggml_type, lin.out_features, torch.randn(7, 1, k))


def test_compute_kind_and_sizes(no_lane):
    assert linear.compute_kind(T.Q4_0, 768, 2048, False) == "int4"
    assert linear.compute_kind(T.Q4_K, 768, 2048, False) == "int4"
    assert linear.compute_kind(T.Q4_K, 96, 2048, False) == "bf16"  # rows not a multiple of 64
    for t in (T.Q8_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.BF16):
        assert linear.compute_kind(t, 768, 2048, False) == "bf16"
    for t in (T.F32, T.F16):
        assert linear.compute_kind(t, 768, 2048, False) == "f32"
    for t in ALL_TYPES:
        assert linear.compute_kind(t, 768, 2048, True) == "f32"
    assert linear.packed_nbytes(T.Q4_K, 768, 2048, False) == 768 * 1024 + 64 * 768 * 4
    assert linear.packed_nbytes(T.Q8_0, 768, 2048, False) == 768 * 2048 * 2
    assert linear.packed_nbytes(T.Q4_0, 768, 2048, True) == 768 * 2048 * 4
    assert linear.compute_kind(T.IQ2_XXS, 768, 2048, False) == "bf16"  # decoded by numpy (slow path)
    assert linear.packed_nbytes(T.IQ2_XXS, 768, 2048, False) == 768 * 2048 * 2
    with pytest.raises(ModelFileError):
        linear.compute_kind(T.Q8_K, 256, 256, False)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_pack_into_stays_inside_out(ggml_type):
    n, k = 64, 256
    raw = random_gguf(ggml_type, n * k, np.random.default_rng(0))
    size = linear.packed_nbytes(ggml_type, n, k, False)
    arena = linear.aligned_empty(size + 256)
    arena.fill_(0xAB)
    out = arena[64 : 64 + size]
    lin = linear.pack_into(raw, ggml_type, n, k, out, False)
    assert (arena[:64] == 0xAB).all() and (arena[64 + size :] == 0xAB).all()
    lo, hi = out.data_ptr(), out.data_ptr() + size
    for t in (lin.weight, lin.scales_zeros):
        if t is not None:
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
    # a second pack into the same slot replaces the form in place
    raw2 = random_gguf(ggml_type, n * k, np.random.default_rng(1))
    lin2 = linear.pack_into(raw2, ggml_type, n, k, out, False)
    x = torch.randn(1, k)
    torch.testing.assert_close(lin(x), lin2(x))
    torch.testing.assert_close(lin(x), linear.from_gguf(raw2, ggml_type, n, k, False)(x))


def test_pack_into_rejects_bad_arguments():
    n, k = 64, 256
    raw = random_gguf(T.Q4_K, n * k, np.random.default_rng(0))
    size = linear.packed_nbytes(T.Q4_K, n, k, False)
    buf = linear.aligned_empty(size + 64)
    with pytest.raises(ValueError, match="aligned|boundary"):
        linear.pack_into(raw, T.Q4_K, n, k, buf[1 : 1 + size], False)
    with pytest.raises(ValueError, match="needs"):
        linear.pack_into(raw, T.Q4_K, n, k, buf[: size - 1], False)
    with pytest.raises(ValueError, match="bytes of GGUF data"):
        linear.pack_into(raw[:-1], T.Q4_K, n, k, buf[:size], False)
    with pytest.raises(ValueError):
        linear.pack_into(raw, T.Q4_K, n, k, buf[:size].view(torch.int8), False)


# ---------------------------------------------------------------------------------------------------------
# the C path against the torch/numpy fallback


def _int4_native(raw, ggml_type, n, k, lib):
    packed = np.zeros(n * k // 2, np.uint8)
    sz = np.zeros(k // 32 * n * 2, np.uint16)
    rows = native.int4_block()
    assert lib.ms_pack_int4(int(ggml_type), raw.ctypes.data, n, k, packed.ctypes.data, sz.ctypes.data, rows) == 0
    return packed, sz


def _int4_torch(raw, ggml_type, n, k):
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    sz = torch.empty(k // 32, n, 2, dtype=torch.bfloat16)
    linear._pack_int4_torch(raw, ggml_type, n, k, packed, sz)
    return packed.numpy().reshape(-1), sz.view(torch.uint16).numpy().reshape(-1)


@needs_native
def test_int4_layout_self_check():
    assert native.int4_layout_ok()


@needs_native
@settings(max_examples=25, deadline=None)
@given(
    ggml_type=st.sampled_from([T.Q4_0, T.Q4_K]),
    n_blocks=st.integers(1, 3),
    k_units=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
    scalar=st.booleans(),
)
def test_int4_pack_native_equals_torch(ggml_type, n_blocks, k_units, seed, scalar):
    n = 64 * n_blocks
    k = k_units * (32 if ggml_type == T.Q4_0 else 256)
    raw = random_gguf(ggml_type, n * k, np.random.default_rng(seed))
    lib = native.lib(("-DMS_SCALAR",) if scalar else ())
    packed, sz = _int4_native(raw, ggml_type, n, k, lib)
    ref_packed, ref_sz = _int4_torch(raw, ggml_type, n, k)
    np.testing.assert_array_equal(packed, ref_packed)
    np.testing.assert_array_equal(sz, ref_sz)


@needs_native
@pytest.mark.parametrize("scalar", [False, True])
def test_native_gemvs_equal_a_float64_product(scalar):
    # the decode step's gemvs (routers in float32, weights without a lane form in bf16), SIMD (AVX-512 or
    # AVX2) and scalar, with a row length off every vector width
    lib = native.lib(("-DMS_SCALAR",) if scalar else ())
    rng = np.random.default_rng(11)
    for n, k, m in ((40, 2056, 3), (7, 17, 1)):
        w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
        x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
        wb = w.bfloat16()
        y32, y16 = torch.empty(m, n), torch.empty(m, n)
        assert lib.ms_gemv_f32(w.data_ptr(), n, k, x.data_ptr(), m, y32.data_ptr()) == 0
        assert lib.ms_gemv_bf16(wb.data_ptr(), n, k, x.data_ptr(), m, y16.data_ptr()) == 0
        tol = 1e-5 * k**0.5 * 4
        torch.testing.assert_close(y32.double(), x.double() @ w.double().T, rtol=0, atol=tol)
        torch.testing.assert_close(y16.double(), x.double() @ wb.double().T, rtol=0, atol=tol)


@needs_native
@pytest.mark.parametrize("scalar", [False, True])
def test_native_decode_attention_equals_sdpa(scalar):
    # one query token over a float16, kv or float32 cache, head sizes that take the SIMD loops (AVX-512 or AVX2) or not
    lib = native.lib(("-DMS_SCALAR",) if scalar else ())
    rng = np.random.default_rng(12)
    for s, h, hkv, d, kv in ((37, 8, 2, 128, 1), (37, 8, 2, 128, 0), (37, 8, 2, 128, 2), (5, 4, 4, 64, 1),
                              (9, 6, 3, 24, 0), (9, 6, 3, 24, 2)):  # fmt: skip
        q = torch.from_numpy(rng.standard_normal((h, d), dtype=np.float32))
        k = torch.from_numpy(rng.standard_normal((s, hkv, d), dtype=np.float32))
        v = torch.from_numpy(rng.standard_normal((s, hkv, d), dtype=np.float32))
        k, v = k.to(KV_DTYPES[kv]), v.to(KV_DTYPES[kv])
        out = torch.empty(h, d)
        rc = lib.ms_attn_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), s, h, hkv, d, kv, d**-0.5, out.data_ptr())
        assert rc == 0
        kh = k.float().transpose(0, 1).repeat_interleave(h // hkv, 0)  # [h, s, d]
        vh = v.float().transpose(0, 1).repeat_interleave(h // hkv, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, None].double(), kh.double(), vh.double())[:, 0]
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


@needs_native
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("kv", [0, 1, 2])
def test_native_decode_attention_with_sinks_equals_the_formula(scalar, kv):
    # GPT-OSS's decode step: a learned logit per query head joins each softmax's denominator, large enough here
    # to take much of the mass, and a window is a slice of the cache
    lib = native.lib(("-DMS_SCALAR",) if scalar else ())
    rng = np.random.default_rng(5)
    s, h, hkv, d = 21, 6, 2, 32
    q = torch.from_numpy(rng.standard_normal((h, d), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((s, hkv, d), dtype=np.float32)).to(KV_DTYPES[kv])
    v = torch.from_numpy(rng.standard_normal((s, hkv, d), dtype=np.float32)).to(KV_DTYPES[kv])
    sinks = torch.from_numpy(rng.standard_normal(h, dtype=np.float32) * 3)
    out = torch.empty(h, d)
    rc = lib.ms_attn_decode_sinks(q.data_ptr(), k.data_ptr(), v.data_ptr(), s, h, hkv, d, kv, d**-0.5,
                                  sinks.data_ptr(), out.data_ptr())  # fmt: skip
    assert rc == 0
    kh = k.double().transpose(0, 1).repeat_interleave(h // hkv, 0)  # [h, s, d]
    vh = v.double().transpose(0, 1).repeat_interleave(h // hkv, 0)
    scores = torch.einsum("hd,hsd->hs", q.double(), kh) * d**-0.5
    probs = torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=1), dim=1)[:, :-1]
    ref = torch.einsum("hs,hsd->hd", probs, vh)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


@needs_native
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize(
    "t, pos, h, hkv, d, kv",
    [
        (130, 70, 16, 2, 256, 1),
        (5, 0, 8, 2, 128, 0),
        (33, 100, 12, 4, 64, 0),
        (64, 3, 4, 4, 128, 1),
        (1, 9, 6, 3, 24, 1),
        (130, 70, 16, 2, 256, 2),
        (33, 100, 12, 4, 64, 2),
    ],
)
def test_native_prompt_attention_equals_sdpa_and_ignores_the_chunking(t, pos, h, hkv, d, kv, scalar):
    # queries at positions pos.. over a float16, kv or float32 cache: GQA and MHA, head sizes 24..256, a last key block
    # cut short, a query block cut short; then the same queries cut in two calls give the same bits
    lib = native.lib(("-DMS_SCALAR",) if scalar else ())
    rng = np.random.default_rng(t)
    s = pos + t
    q = torch.from_numpy(rng.standard_normal((t, h, d), dtype=np.float32)) * 2
    k = torch.from_numpy(rng.standard_normal((s, hkv, d), dtype=np.float32)) * 2
    v = torch.from_numpy(rng.standard_normal((s, hkv, d), dtype=np.float32))
    k, v = k.to(KV_DTYPES[kv]), v.to(KV_DTYPES[kv])

    def run(a: int, b: int) -> torch.Tensor:
        out = torch.empty(b - a, h, d)
        qc = q[a:b].contiguous()
        rc = lib.ms_attn_prefill(qc.data_ptr(), k.data_ptr(), v.data_ptr(), b - a, s, h, hkv, d, pos + a, kv,
                                 d**-0.5, out.data_ptr())  # fmt: skip
        assert rc == 0
        return out

    out = run(0, t)
    kh = k.double().transpose(0, 1).repeat_interleave(h // hkv, 0)  # [h, s, d]
    vh = v.double().transpose(0, 1).repeat_interleave(h // hkv, 0)
    mask = torch.arange(s)[None, :] <= torch.arange(pos, pos + t)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(0, 1), kh, vh, attn_mask=mask)
    torch.testing.assert_close(out.double(), ref.transpose(0, 1), rtol=0, atol=2e-5)
    cut = t // 3 + 1
    assert torch.equal(torch.cat([run(0, cut), run(cut, t)]), out)


@needs_native
@pytest.mark.parametrize("kv", [0, 1, 2])
def test_native_prompt_attention_ignores_what_the_cache_holds_past_the_prompt(kv):
    # a cache longer than the prompt, NaN past its last position (in the last key block the queries read): the
    # rows are those of the exactly sized cache, bit for bit
    t, pos, h, hkv, d = 20, 10, 4, 2, 32
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.standard_normal((t, h, d), dtype=np.float32))
    k = torch.full((pos + t + 7, hkv, d), float("nan"))
    v = torch.full((pos + t + 7, hkv, d), float("nan"))
    k[: pos + t] = torch.from_numpy(rng.standard_normal((pos + t, hkv, d), dtype=np.float32))
    v[: pos + t] = torch.from_numpy(rng.standard_normal((pos + t, hkv, d), dtype=np.float32))
    k, v = k.to(KV_DTYPES[kv]), v.to(KV_DTYPES[kv])
    lib = native.lib()
    outs = []
    for s in (pos + t, pos + t + 7):
        out = torch.empty(t, h, d)
        kc, vc = k[:s].contiguous(), v[:s].contiguous()
        assert lib.ms_attn_prefill(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), t, s, h, hkv, d, pos, kv,
                                   d**-0.5, out.data_ptr()) == 0  # fmt: skip
        outs.append(out)
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.skipif(native.lane_isa() != "avx512-vnni", reason="compares the AVX2 build with the AVX-512 one")
@pytest.mark.parametrize(
    "t, pos, h, hkv, d, kv", [(130, 70, 16, 2, 256, 1), (33, 100, 12, 4, 64, 0), (33, 100, 12, 4, 64, 2)]
)
def test_native_prompt_attention_gives_the_same_bits_with_avx2(t, pos, h, hkv, d, kv):
    # gemm.h's 16-float tiles take each sum in the order of the 8-float ones, and attn.c's softmax is 8 lanes
    # wide in both builds: this CPU's library built without AVX-512 gives the same bits
    rng = np.random.default_rng(t)
    q = torch.from_numpy(rng.standard_normal((t, h, d), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((pos + t, hkv, d), dtype=np.float32))
    v = torch.from_numpy(rng.standard_normal((pos + t, hkv, d), dtype=np.float32))
    k, v = k.to(KV_DTYPES[kv]), v.to(KV_DTYPES[kv])
    outs = []
    for lib in (native.lib(), native.lib(("-mno-avx512f",))):
        out = torch.empty(t, h, d)
        rc = lib.ms_attn_prefill(q.data_ptr(), k.data_ptr(), v.data_ptr(), t, pos + t, h, hkv, d, pos, kv,
                                 d**-0.5, out.data_ptr())  # fmt: skip
        assert rc == 0
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))


@needs_native
@pytest.mark.parametrize("rows", [32, 64])
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K], ids=lambda t: t.name)
def test_int4_either_layout_expands_to_its_weights(ggml_type, scalar, rows):
    # torch packs blocks of 64 rows where its kernels run AVX-512 and of 32 with AVX2: both round-trip here,
    # whichever this machine's torch uses (test_int4_pack_native_equals_torch checks that one against torch)
    n, k = 128, 512
    raw = random_gguf(ggml_type, n * k, np.random.default_rng(7))
    lib = native.lib(("-DMS_SCALAR",) if scalar else ())
    packed, sz = np.zeros(n * k // 2, np.uint8), np.zeros(k // 32 * n * 2, np.uint16)
    assert lib.ms_pack_int4(int(ggml_type), raw.ctypes.data, n, k, packed.ctypes.data, sz.ctypes.data, rows) == 0
    out = np.zeros(n * k, np.uint16)
    assert lib.ms_int4_to_bf16(packed.ctypes.data, sz.ctypes.data, n, k, 0, n, out.ctypes.data, rows) == 0
    q, _ = linear.int4_parts_numpy(raw, ggml_type, n, k)
    scale_zero = torch.from_numpy(sz.view(np.int16)).view(torch.bfloat16).float().view(k // 32, n, 2)
    scale, zero = scale_zero[..., 0].T[:, :, None], scale_zero[..., 1].T[:, :, None]  # [n, k/32, 1]
    ref = ((torch.from_numpy(q).float() - 8).view(n, k // 32, 32) * scale + zero).view(n, k).bfloat16()
    assert torch.equal(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).view(n, k), ref)


@needs_native
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_dequant_native_equals_numpy(ggml_type, scalar):
    n_elems = 4 * 256 + (0 if quants.BLOCK_SIZES[ggml_type][0] > 1 else 3)
    raw = random_gguf(ggml_type, n_elems, np.random.default_rng(5))
    lib = native.lib(("-DMS_SCALAR",) if scalar else ())
    assert lib.ms_has_simd() == (0 if scalar else 1)
    ref = quants.dequantize(raw, ggml_type, (n_elems,))
    f32 = np.empty(n_elems, np.float32)
    bf16 = np.empty(n_elems, np.uint16)
    assert lib.ms_dequant(int(ggml_type), raw.ctypes.data, n_elems, f32.ctypes.data, 0) == 0
    assert lib.ms_dequant(int(ggml_type), raw.ctypes.data, n_elems, bf16.ctypes.data, 1) == 0
    np.testing.assert_array_equal(f32, ref)
    np.testing.assert_array_equal(bf16, torch.from_numpy(ref).bfloat16().view(torch.uint16).numpy())


@needs_native
def test_dequant_rejects_bad_input():
    lib = native.lib()
    buf = np.zeros(1024, np.uint8)
    p = buf.ctypes.data
    with pytest.raises(ComputeError, match=r"ms_dequant\(.*unsupported weight type \(code -1\)"):
        lib.ms_dequant(int(T.IQ2_XXS), p, 256, p, 0)
    with pytest.raises(ComputeError, match="sizes or counts"):
        lib.ms_dequant(int(T.Q4_K), p, 100, p, 0)
    with pytest.raises(ComputeError, match="sizes or counts"):
        lib.ms_dequant(int(T.Q8_0), p, 0, p, 0)
    with pytest.raises(ComputeError, match="null or misaligned"):
        lib.ms_dequant(int(T.F32), p + 1, 4, p, 0)
    with pytest.raises(ComputeError, match="sizes or counts"):
        lib.ms_pack_int4(int(T.Q4_0), p, 32, 32, p, p, 64)
    with pytest.raises(ComputeError, match="unsupported weight type"):
        lib.ms_pack_int4(int(T.Q8_0), p, 64, 32, p, p, 64)
    with pytest.raises(ComputeError, match="null or misaligned"):
        lib.ms_pack_int4(int(T.Q4_0), None, 64, 32, p, p, 64)
    with pytest.raises(ComputeError, match="sizes or counts"):
        lib.ms_pack_int4(int(T.Q4_0), p, 64, 32, p, p, 48)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_pack_into_without_native(monkeypatch, no_lane, ggml_type):
    n, k = 128, 512
    raw = random_gguf(ggml_type, n * k, np.random.default_rng(9))
    with_c = linear.from_gguf(raw, ggml_type, n, k, False)
    monkeypatch.setattr(native, "lib", lambda extra_flags=(): None)
    without = linear.from_gguf(raw, ggml_type, n, k, False)
    assert torch.equal(with_c.weight, without.weight)
    if with_c.scales_zeros is not None:
        assert torch.equal(with_c.scales_zeros.view(torch.int16), without.scales_zeros.view(torch.int16))


@needs_native
def test_reader_threads_pack_in_parallel():
    n, k = 256, 1024
    raws = [random_gguf(T.Q4_K, n * k, np.random.default_rng(i)) for i in range(8)]
    size = linear.packed_nbytes(T.Q4_K, n, k, False)
    arena = linear.aligned_empty(size * len(raws))
    results: dict[int, linear.QLinear] = {}

    def work(i: int) -> None:
        results[i] = linear.pack_into(raws[i], T.Q4_K, n, k, arena[i * size : (i + 1) * size], False)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(raws))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    x = torch.randn(1, k)
    for i, raw in enumerate(raws):
        torch.testing.assert_close(results[i](x), linear.from_gguf(raw, T.Q4_K, n, k, False)(x))


def _eye_dense(lin: linear.QLinear) -> torch.Tensor:
    """W as the int4 kernel itself sees it: the kernel applied to the identity."""
    eye = torch.eye(lin.in_features, dtype=torch.bfloat16)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, lin.weight, 32, lin.scales_zeros).float().T


@needs_native
@pytest.mark.parametrize("scalar", [False, True])
def test_int4_expansion_equals_kernel(no_lane, scalar):
    n, k = 192, 512
    lin = linear.from_gguf(random_gguf(T.Q4_K, n * k, np.random.default_rng(3)), T.Q4_K, n, k, False)
    lib = native.lib(("-DMS_SCALAR",) if scalar else ())
    full = torch.empty(n, k, dtype=torch.bfloat16)
    lin._expand(lib, 0, n, full)
    assert torch.equal(full.float(), _eye_dense(lin))
    part = torch.empty(64, k, dtype=torch.bfloat16)
    lin._expand(lib, 64, 128, part)
    assert torch.equal(part, full[64:128])
    with pytest.raises(ComputeError, match="ms_int4_to_bf16"):
        lib.ms_int4_to_bf16(lin.weight.data_ptr(), lin.scales_zeros.data_ptr(), n, k, 32, 96, part.data_ptr(), 64)
    with pytest.raises(ComputeError, match="ms_int4_to_bf16"):
        lib.ms_int4_to_bf16(lin.weight.data_ptr(), lin.scales_zeros.data_ptr(), n, k, 64, 256, part.data_ptr(), 64)


@needs_native
@pytest.mark.parametrize("scratch", [linear.EXPAND_SCRATCH_BYTES, 64 * 512 * 2])
def test_many_rows_use_bf16_gemm(monkeypatch, no_lane, scratch):
    monkeypatch.setattr(linear, "EXPAND_SCRATCH_BYTES", scratch)  # small: expands 64 rows at a time
    n, k = 192, 512
    raw = random_gguf(T.Q4_0, n * k, np.random.default_rng(4))
    lin = linear.from_gguf(raw, T.Q4_0, n, k, False)
    x = torch.randn(linear.INT4_GEMM_MIN_ROWS + 3, k)
    ref = x @ torch.from_numpy(reference(raw, T.Q4_0, (n, k))).T
    y = lin(x)
    assert rel_err(y, ref) < 1e-2
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), lin.weight, 32, lin.scales_zeros).float()
    assert rel_err(y, kernel) < 1e-2


# ---------------------------------------------------------------------------------------------------------
# the loader


@pytest.mark.slow
@needs_native
def test_build_is_atomic_under_concurrency(tmp_path):
    cc = native._compiler()
    flags = (*native.BASE_FLAGS, "-DMS_SCALAR")
    paths, errors = [], []

    def build() -> None:
        try:
            paths.append(native.build_library(flags, tmp_path, cc))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temp files left behind


def test_missing_compiler_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setattr(native, "_warned", False)
    with pytest.warns(RuntimeWarning, match="native weight conversion unavailable"):
        assert native.lib() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.lib(("-DOTHER",)) is None
