"""Our numpy GGUF decoders/encoders against the gguf package's reference implementation."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moestream.errors import ModelFileError
from moestream.formats import quants

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
# decoded by formats/lowbit.py (tests/test_quant_types.py has their own tests)
LOWBIT_TYPES = [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S,
                T.IQ1_M, T.TQ1_0, T.TQ2_0, T.MXFP4]  # fmt: skip
ALL_TYPES = [T.F32, T.F16, T.BF16, *BLOCK_TYPES, *LOWBIT_TYPES]
random_gguf = quants.random_gguf


def reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(gq.dequantize(raw.reshape(shape[0], -1), T(ggml_type)), dtype=np.float32).reshape(shape)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_decoder_matches_gguf(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    shape = (6, 512)
    raw = random_gguf(ggml_type, 6 * 512, rng)
    assert raw.size == quants.tensor_nbytes(ggml_type, 6 * 512)
    ours = quants.dequantize(raw, ggml_type, shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours, reference(raw, ggml_type, shape))


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows(ggml_type):
    rng = np.random.default_rng(7)
    n_rows, n_cols = 40, 256
    raw = random_gguf(ggml_type, n_rows * n_cols, rng)
    full = quants.dequantize(raw, ggml_type, (n_rows, n_cols))
    rows = np.array([3, 0, 39, 3, 17])
    np.testing.assert_array_equal(quants.dequantize_rows(raw, ggml_type, n_cols, rows), full[rows])
    np.testing.assert_array_equal(quants.dequantize_rows(memoryview(raw.tobytes()), ggml_type, n_cols, [5]), full[[5]])
    assert quants.dequantize_rows(raw, ggml_type, n_cols, []).shape == (0, n_cols)
    with pytest.raises(IndexError):
        quants.dequantize_rows(raw, ggml_type, n_cols, [n_rows])


def test_sizes_and_unsupported_types():
    assert quants.tensor_nbytes(T.Q4_K, 512) == 288
    assert quants.tensor_nbytes(T.Q4_0, 64) == 36
    assert quants.tensor_nbytes(T.BF16, 3) == 6
    assert quants.SUPPORTED_TYPES == {int(t) for t in ALL_TYPES} | {quants.FP8_B128}  # and checkpoints' FP8
    with pytest.raises(ValueError):
        quants.tensor_nbytes(T.Q4_K, 100)
    with pytest.raises(ModelFileError, match="Q8_K"):  # llama.cpp's activation type: never in a model file
        quants.tensor_nbytes(T.Q8_K, 256)


def test_k_scale_min_packing_roundtrip():
    rng = np.random.default_rng(0)
    sc = rng.integers(0, 64, (100, 8), dtype=np.uint8)
    mn = rng.integers(0, 64, (100, 8), dtype=np.uint8)
    packed = quants.pack_k_scale_min(sc, mn)
    sc2, mn2 = quants.k_scale_min(packed)
    np.testing.assert_array_equal(sc, sc2)
    np.testing.assert_array_equal(mn, mn2)
    # and the reference unpacker agrees
    ref_sc, ref_mn = gq.Q4_K.get_scale_min(packed)
    np.testing.assert_array_equal(sc, ref_sc)
    np.testing.assert_array_equal(mn, ref_mn)


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


@pytest.mark.parametrize(
    "ggml_type,bound", [(T.Q4_K, 0.08), (T.Q6_K, 0.025), (T.Q8_0, 0.008), (T.Q4_0, 0.1), (T.BF16, 0.004)]
)
def test_quantize_roundtrip_gaussian(ggml_type, bound):
    w = np.random.default_rng(1).standard_normal((32, 1024)).astype(np.float32)
    raw = quants.quantize(w, ggml_type)
    assert raw.dtype == np.uint8 and raw.shape == (32, quants.tensor_nbytes(ggml_type, 1024))
    back = reference(raw, ggml_type, w.shape)
    assert rel_rms(back, w) < bound


def test_q4_k_search_beats_min_max():
    rng = np.random.default_rng(2)
    for w in (rng.standard_normal((64, 256)), rng.standard_t(3, (64, 256)), rng.random((64, 256)) - 0.2):
        w = w.astype(np.float32)
        searched = quants._q4_k_encode(w, search=True)
        naive = quants._q4_k_encode(w, search=False)
        err_s = rel_rms(reference(searched, T.Q4_K, w.shape), w)
        err_n = rel_rms(reference(naive, T.Q4_K, w.shape), w)
        assert err_s < 0.95 * err_n, (err_s, err_n)


def test_quantize_matches_gguf_where_gguf_has_one():
    w = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    for t in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16, T.F16):
        np.testing.assert_array_equal(quants.quantize(w, t), np.asarray(gq.quantize(w, t)).view(np.uint8))
    np.testing.assert_array_equal(quants.dequantize(quants.quantize(w, T.F32), T.F32, w.shape), w)


def test_quantize_degenerate_blocks():
    w = np.zeros((3, 256), np.float32)
    w[1] = 0.25  # constant, positive: the min must stay <= 0
    w[2, :32] = -3.0
    for t in (T.Q4_K, T.Q6_K):
        back = reference(quants.quantize(w, t), t, w.shape)
        assert np.isfinite(back).all()
        np.testing.assert_allclose(back, w, atol=0.02 * 3)


@settings(max_examples=40, deadline=None)
@given(
    w=hnp.arrays(np.float32, (2, 256), elements=st.floats(-1, 1, width=32)),
    scale=st.sampled_from([1e-2, 1.0, 100.0]),
    ggml_type=st.sampled_from([T.Q4_K, T.Q6_K]),
)
def test_k_quantizers_bounded_error(w, scale, ggml_type):
    w = w * np.float32(scale)
    back = reference(quants.quantize(w, ggml_type), ggml_type, w.shape)
    assert np.isfinite(back).all()
    # per super-block, no weight is off by more than a fraction of the block's largest magnitude
    peak = np.abs(w).max(axis=1, keepdims=True)
    frac = 0.15 if ggml_type == T.Q4_K else 0.05
    # Below ~6e-5 a block's fp16 super-block scale (d = peak / 63 / 15 for Q4_K) underflows and the block
    # can only come back as zeros: that much absolute error is the format's, not the quantizer's.
    fp16_floor = 2.0**-24 * 63 * 15
    assert (np.abs(back - w) <= frac * peak + fp16_floor).all()


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    ggml_type=st.sampled_from(BLOCK_TYPES + LOWBIT_TYPES),
    n_rows=st.integers(1, 5),
    n_blocks=st.integers(1, 3),
)
def test_decoders_match_gguf_random_shapes(seed, ggml_type, n_rows, n_blocks):
    block = quants.BLOCK_SIZES[ggml_type][0]
    shape = (n_rows, n_blocks * block)
    raw = random_gguf(ggml_type, n_rows * n_blocks * block, np.random.default_rng(seed))
    np.testing.assert_array_equal(quants.dequantize(raw, ggml_type, shape), reference(raw, ggml_type, shape))
