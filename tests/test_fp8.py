"""The FP8 compute form (native/fp8.c, quants.FP8_B128): checkpoint FP8 e4m3 weights with 128-column block
scales kept at 1 byte a weight and multiplied by the native kernel, against torch's float8_e4m3fn decode times
the scales; the AVX-512, AVX2 and scalar builds give the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream.compute import kernels, linear, native
from moestream.errors import ComputeError
from moestream.formats import quants
from moestream.paths import cache_dir

pytestmark = pytest.mark.skipif(native.lib() is None, reason="needs the C library")
FP8 = quants.FP8_B128
NAN_BYTES = (0x7F, 0xFF)


def _weights(n: int, k: int, bn: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Every byte value but the NaNs, in random order, and scales of several magnitudes."""
    rng = np.random.default_rng(seed)
    values = np.setdiff1d(np.arange(256), NAN_BYTES).astype(np.uint8)
    raw = values[rng.integers(0, values.size, n * k)]
    raw[: min(values.size, n * k)] = values[: n * k]
    scales = np.exp2(rng.integers(-12, 4, (-(-n // bn), k // 128))) * rng.uniform(1, 2, (-(-n // bn), k // 128))
    return raw, scales.astype(np.float32)


def _reference(raw: np.ndarray, scales: np.ndarray, n: int, k: int, bn: int) -> torch.Tensor:
    w = torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn).float().view(n, k)
    return w * torch.from_numpy(scales).repeat_interleave(bn, 0)[:n].repeat_interleave(128, 1)


SHAPES = [(1, 128, 128), (70, 384, 128), (33, 2048, 128), (256, 768, 64)]  # (n, k, rows per scale)


@pytest.mark.parametrize("n,k,bn", SHAPES)
def test_fp8_form_decodes_to_torchs_values(n, k, bn):
    raw, scales = _weights(n, k, bn, n + k)
    form = kernels.fp8_pack(raw, n, k, scales, bn)
    assert form.size == n * k // 128 * 132 == quants.tensor_nbytes(FP8, n * k)
    lin = linear.from_gguf(form, FP8, n, k, False)
    assert lin.kind == "fp8" and lin.nbytes == form.size
    ref = _reference(raw, scales, n, k, bn)
    assert torch.equal(lin.dense(), ref)
    np.testing.assert_array_equal(quants.dequantize(form, FP8, (n, k)), ref.numpy())  # the numpy decoder
    # exact mode's float32 form holds the same products
    assert torch.equal(linear.from_gguf(form, FP8, n, k, True).weight, ref)


def test_fp8_pack_without_the_c_library_gives_the_same_bytes(monkeypatch):
    n, k, bn = 70, 384, 128
    raw, scales = _weights(n, k, bn, 5)
    want = kernels.fp8_pack(raw, n, k, scales, bn)
    monkeypatch.setattr(native, "lib", lambda *a: None)
    np.testing.assert_array_equal(kernels.fp8_pack(raw, n, k, scales, bn), want)
    assert linear.compute_kind(FP8, n, k, False) == "bf16"  # decoded by numpy then


@pytest.mark.parametrize("n,k,bn", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 6, 20])
def test_fp8_matmul_equals_the_decoded_weights_product(n, k, bn, m):
    raw, scales = _weights(n, k, bn, 7 * n + k)
    lin = linear.from_gguf(kernels.fp8_pack(raw, n, k, scales, bn), FP8, n, k, False)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = (x.double() @ _reference(raw, scales, n, k, bn).double().T).float()
    got = lin(x)
    scale = (x.abs().double() @ _reference(raw, scales, n, k, bn).abs().double().T).float()
    assert torch.all((got - want).abs() <= 1e-5 * scale + 1e-30), (got - want).abs().max()


def test_fp8_pack_refuses_nans_and_ragged_rows():
    raw, scales = _weights(4, 256, 128, 1)
    for b in NAN_BYTES:
        bad = raw.copy()
        bad[300] = b
        with pytest.raises(ComputeError, match="non-finite"):
            kernels.fp8_pack(bad, 4, 256, scales, 128)
    with pytest.raises(ValueError, match="128"):
        kernels.fp8_pack(raw[: 4 * 200], 4, 200, scales[:, :1], 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        linear.compute_kind(FP8, 4, 200, False)


@pytest.fixture(scope="module")
def other_builds():
    """The AVX2 build (where this CPU has AVX-512) and the portable C one."""
    builds = {"scalar": native.lib(("-DMS_SCALAR",))}
    if native.lane_isa() == "avx512-vnni":
        flags = (*native.BASE_FLAGS, "-march=native", "-mno-avx512f")
        builds["avx2"] = native.load_library(native.build_library(flags, cache_dir()))
    return builds


def test_every_build_gives_the_same_bits(other_builds):
    for n, k, bn in SHAPES:
        raw, scales = _weights(n, k, bn, 3 * n + k)
        lin = linear.from_gguf(kernels.fp8_pack(raw, n, k, scales, bn), FP8, n, k, False)
        for m in (1, 5):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(n + m))
            want = lin(x)
            for name, lib in other_builds.items():
                got = torch.empty(m, n)
                lib.ms_fp8_mm(lin.weight.data_ptr(), n, k, x.data_ptr(), m, got.data_ptr())
                assert torch.equal(got, want), (name, n, k, m)
