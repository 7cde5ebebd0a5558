"""The compute form of one weight matrix: GGUF bytes in, `y = x @ W.T` out.

Five forms, picked per tensor by `compute_kind`:
  lane  Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q8_0 / IQ4_XS / Q3_K / Q2_K / Q5_0 / Q5_1 / MXFP4 kept at their own bits in
        the lane layout of native/internal.h (a reshuffle of the GGUF blocks, about the same size, by
        lane_pack.c) and multiplied by the kernels of qmm_vnni.c (AVX-512 VNNI) or qmm_avx2.c (AVX2 + FMA +
        F16C, the same results) against int8-quantized activations, as llama.cpp does. Needs one of those
        and rows of a multiple of 256 (of 32 for Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / MXFP4, whose scales are per
        32 weights); else one of:
  int4  Q4_0 / Q4_K kept at 4 bits in torch's CPU int4pack layout and multiplied with
        `_weight_int4pack_mm_for_cpu` (torch's fastest CPU matvec for 4-bit weights; both formats map onto
        it exactly up to bf16 rounding of each group's scale and zero).
  bf16  every other quantized type (and BF16): decoded once, F.linear in bf16 (in float32 on exact copies, a
        slice at a time, where the CPU has no bf16 GEMM: `linear_bf16`). The types the C library
        cannot decode (the 1-3 bit K/IQ/ternary types, IQ4: `DECODED_TYPES`) are decoded by numpy,
        once per cache fill for an expert and once at load for a resident weight: correct, but slower.
  fp8   a checkpoint's FP8 e4m3 weights with 128-column block scales (quants.FP8_B128): 1 byte a weight plus
        its block's scale, widened in registers by native/fp8.c and multiplied by float32 activations (a few
        rows), or widened to float32 a slice at a time for a float32 GEMM (many rows). bf16 where there
        is no C library.
  f32   F32/F16 weights, and everything when exact=True (logits checked against a float reference).

`pack_into` writes the form into memory the caller owns (the expert cache's slots) and returns views of
it; the conversion runs in C with the GIL released so reader threads convert in parallel.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from moestream.compute import kernels, native
from moestream.errors import ComputeError
from moestream.formats import lowbit, quants

GROUP = 32  # int4 group size along K: one Q4_0 block or one Q4_K sub-block
INT4_BLOCK_N = 64  # rows an int4 weight is a multiple of: the larger of torch's CPU layouts (native.int4_block)
ALIGN = 64

# From this many rows of activations on, expanding the int4 form to bf16 and running a bf16 GEMM beats
# the int4 kernel: the expansion costs a fixed amount per weight, then each row of GEMM costs less than a row
# of the int4 kernel. The crossover lies further out with more threads; this is past the two-thread one.
INT4_GEMM_MIN_ROWS = 48
EXPAND_SCRATCH_BYTES = 8 << 20  # bf16 scratch for one slice of an expanded weight
# fewer rows than this: a bf16 GEMM even where it is emulated, as converting the weight would cost more
F32_GEMM_MIN_ROWS = 16
# Up to this many rows of activations a bf16 weight is multiplied by the C library's gemv on the lane pool
# rather than by torch: a decode step then runs no heavy torch op, and torch can keep one thread.
GEMV_MAX_ROWS = 4

INT4_TYPES = frozenset({int(T.Q4_0), int(T.Q4_K)})
LANE_TYPES = frozenset(
    int(t) for t in (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_XS, T.Q3_K, T.Q2_K, T.Q5_0, T.Q5_1, T.MXFP4)
)
LANE_K = 256  # rows must be whole groups of the lane layout
# ... or, for the types with a scale per 32 weights, whole blocks of 32 (V2-Lite's 1408-wide expert downs)
LANE_K_PER32 = frozenset(int(t) for t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.MXFP4))
F32_TYPES = frozenset({int(T.F32), int(T.F16)})
# no native decoder: numpy widens them (see slow_path); the C library decodes MXFP4 (pack.c)
DECODED_TYPES = frozenset(lowbit.DECODERS) - {int(T.MXFP4)}
DECODE_ROWS_BYTES = 4 << 20  # float32 rows decoded at a time by the numpy path (bounds its temporaries)
FP8 = quants.FP8_B128
# From this many rows of activations on, an FP8 weight is widened to float32 a slice at a time for a GEMM: its
# kernel widens every weight once per FP8_XT rows and runs no cache tiling, which a GEMM's rows amortize.
FP8_GEMM_MIN_ROWS = 16


@dataclass(eq=False)
class QLinear:
    """y = x @ W.T for a weight read from GGUF bytes, held in the form our kernels compute from."""

    out_features: int
    in_features: int
    kind: str  # 'lane' | 'int4' | 'fp8' | 'bf16' | 'f32'
    weight: torch.Tensor  # lane, fp8: uint8 [N, row bytes]; int4: uint8 [N, K/2] packed; bf16/f32: [N, K]
    scales_zeros: torch.Tensor | None = None  # int4 only: bf16 [K/32, N, 2]
    ggml_type: int = -1  # lane only: the GGUF type its blocks came from

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [..., K] -> float32 [..., N]."""
        lead = x.shape[:-1]
        if self.kind in ("lane", "fp8"):
            return self.mm(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)
        if self.kind == "int4":
            # the int4 kernel's fast path takes bf16 activations (float32 ones go to a far slower path)
            x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            if x2.shape[0] >= INT4_GEMM_MIN_ROWS and (lib := _int4_expander()) is not None:
                y = self._expanded_mm(x2, lib)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, GROUP, self.scales_zeros)
            return y.float().reshape(*lead, self.out_features)
        if self.kind == "bf16":
            x2 = x.reshape(-1, self.in_features)
            if x2.shape[0] <= GEMV_MAX_ROWS and (lib := native.lib()) is not None and self.weight.is_contiguous():
                return self._gemv_bf16(lib, x2.to(torch.bfloat16).float()).reshape(*lead, self.out_features)
            return linear_bf16(x2.to(torch.bfloat16), self.weight).float().reshape(*lead, self.out_features)
        return F.linear(x, self.weight)

    def _gemv_bf16(self, lib: Any, x2: torch.Tensor) -> torch.Tensor:
        """float32 [M, K] @ the bf16 W.T -> float32 [M, N] on the lane pool (a decode step's few rows)."""
        x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features)
        lib.ms_gemv_bf16(self.weight.data_ptr(), self.out_features, self.in_features, x2.data_ptr(), x2.shape[0],
                         y.data_ptr())  # fmt: skip
        return y

    def _expanded_mm(self, x2: torch.Tensor, lib: Any) -> torch.Tensor:
        """x2 bf16 [M, K] @ W.T by bf16 GEMMs over W expanded a slice of rows at a time (bounded scratch)."""
        n, k = self.out_features, self.in_features
        step = max(INT4_BLOCK_N, EXPAND_SCRATCH_BYTES // (2 * k) // INT4_BLOCK_N * INT4_BLOCK_N)
        scratch = torch.empty(min(step, n), k, dtype=torch.bfloat16)
        parts = []
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            w = scratch[: r1 - r0]
            self._expand(lib, r0, r1, w)
            parts.append(linear_bf16(x2, w))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _expand(self, lib: Any, r0: int, r1: int, out: torch.Tensor) -> None:
        """Rows [r0, r1) of the int4 form -> bf16 `out` [r1 - r0, K] (contiguous)."""
        n, k = self.out_features, self.in_features
        assert out.is_contiguous() and out.dtype == torch.bfloat16 and out.shape == (r1 - r0, k)
        lib.ms_int4_to_bf16(self.weight.data_ptr(), self.scales_zeros.data_ptr(), n, k, r0, r1, out.data_ptr(),
                            native.int4_block())  # fmt: skip

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype this weight computes in natively (see `mm`)."""
        return torch.float32 if self.kind in ("f32", "lane", "fp8") else torch.bfloat16

    def mm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] already in `self.dtype` -> [M, N] in `self.dtype`: no conversions, for hot loops."""
        if self.kind == "lane":
            x2 = x2.contiguous()
            if not _rows_ok(x2, self.in_features):
                raise ComputeError(f"a lane matmul of {tuple(self.shape)} got an input {_desc(x2)}")
            y = torch.empty(x2.shape[0], self.out_features)
            native.lib().ms_qmm(
                self.ggml_type, self.weight.data_ptr(), self.out_features, self.in_features,
                x2.data_ptr(), x2.shape[0], self.in_features, y.data_ptr(), self.out_features,
            )  # fmt: skip
            return y
        if self.kind == "fp8":
            x2 = x2.contiguous()
            if not _rows_ok(x2, self.in_features):
                raise ComputeError(f"an fp8 matmul of {tuple(self.shape)} got an input {_desc(x2)}")
            return kernels.fp8_mm(self.weight, self.out_features, self.in_features, x2, FP8_GEMM_MIN_ROWS)
        if self.kind == "int4":
            if x2.shape[0] >= INT4_GEMM_MIN_ROWS and (lib := _int4_expander()) is not None:
                return self._expanded_mm(x2, lib)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, GROUP, self.scales_zeros)
        if self.kind == "bf16" and x2.shape[0] <= GEMV_MAX_ROWS and (lib := native.lib()) is not None:
            if self.weight.is_contiguous():
                return self._gemv_bf16(lib, x2.float()).to(torch.bfloat16)
        if self.kind == "bf16":
            return linear_bf16(x2, self.weight)
        return F.linear(x2, self.weight)

    @property
    def nbytes(self) -> int:
        """Bytes of the compute form."""
        n = self.weight.numel() * self.weight.element_size()
        if self.scales_zeros is not None:
            n += self.scales_zeros.numel() * self.scales_zeros.element_size()
        return n

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def dense(self) -> torch.Tensor:
        """W as float32 [N, K], as the kernels see it (tests, debugging)."""
        if self.kind == "lane":
            w = torch.empty(self.out_features, self.in_features)
            native.lib().ms_lane_unpack(
                self.ggml_type, self.weight.data_ptr(), self.out_features, self.in_features, w.data_ptr()
            )
            return w
        if self.kind == "fp8":
            w = torch.empty(self.out_features, self.in_features)
            native.lib().ms_fp8_unpack(self.weight.data_ptr(), self.out_features, self.in_features, w.data_ptr(), 0)
            return w
        if self.kind != "int4":
            return self.weight.float()
        if (lib := _int4_expander()) is not None:
            w = torch.empty(self.out_features, self.in_features, dtype=torch.bfloat16)
            self._expand(lib, 0, self.out_features, w)
            return w.float()
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight, GROUP, self.scales_zeros)
        return w_t.float().T.contiguous()


def concat(parts: list[QLinear]) -> QLinear | None:
    """One QLinear computing all parts' outputs side by side (e.g. fused q/k/v), or None if the forms differ.

    The int4 layout is blocked by 64 rows, so stacking whole blocks along N is a plain concatenation.
    """
    kind, k, gt = parts[0].kind, parts[0].in_features, parts[0].ggml_type
    if any(p.kind != kind or p.in_features != k or p.ggml_type != gt for p in parts):
        return None
    n = sum(p.out_features for p in parts)
    weight = torch.cat([p.weight for p in parts], dim=0)
    if kind in ("lane", "fp8"):  # rows are independent in the lane and FP8 forms
        return QLinear(n, k, kind, weight, ggml_type=gt)
    sz = None
    if kind == "int4":
        if any(p.out_features % INT4_BLOCK_N for p in parts):
            return None
        sz = torch.cat([p.scales_zeros for p in parts], dim=1).contiguous()  # type: ignore[misc]
    return QLinear(n, k, kind, weight, sz)


def compute_kind(ggml_type: int, n: int, k: int, exact: bool) -> str:
    """Which form a [n, k] weight of `ggml_type` is computed in."""
    quants.tensor_nbytes(ggml_type, k)  # raises for an unsupported type or a ragged row
    if exact or ggml_type in F32_TYPES:
        return "f32"
    if ggml_type == FP8:
        return "fp8" if native.lib() is not None else "bf16"
    if ggml_type in LANE_TYPES and k % lane_k(ggml_type) == 0 and native.lane_ok():
        return "lane"
    if ggml_type in INT4_TYPES and n % INT4_BLOCK_N == 0 and k % GROUP == 0:
        return "int4"
    return "bf16"


def lane_k(ggml_type: int) -> int:
    """What the row length of a lane-form weight of `ggml_type` must be a multiple of."""
    return 32 if ggml_type in LANE_K_PER32 else LANE_K


def slow_path(ggml_type: int, n: int, k: int, exact: bool) -> bool:
    """True when a [n, k] weight of `ggml_type` is widened by numpy rather than computed at its own bits or
    decoded by the C library (the load-time note names these types)."""
    return ggml_type in DECODED_TYPES and compute_kind(ggml_type, n, k, exact) in ("bf16", "f32")


def lane_row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of a [*, k] weight in the lane layout (the same as its GGUF row for Q4_0 and Q8_0);
    the C library's own table, so the two cannot disagree."""
    return int(native.lib().ms_lane_row_bytes(ggml_type, k))


def _int4_sizes(n: int, k: int) -> tuple[int, int]:
    return n * k // 2, (k // GROUP) * n * 2 * 2


def packed_nbytes(ggml_type: int, n: int, k: int, exact: bool) -> int:
    """Bytes of the compute form (what `pack_into` needs in `out`)."""
    kind = compute_kind(ggml_type, n, k, exact)
    if kind == "lane":
        return n * lane_row_bytes(ggml_type, k)
    if kind == "fp8":
        return quants.tensor_nbytes(FP8, n * k)
    if kind == "int4":
        return sum(_int4_sizes(n, k))
    return n * k * (2 if kind == "bf16" else 4)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] whose first byte is 64-byte aligned."""
    buf = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-buf.data_ptr()) % ALIGN
    return buf[skip : skip + nbytes]


def _raw_array(raw: np.ndarray | memoryview, ggml_type: int, n: int, k: int) -> np.ndarray:
    arr = quants.as_bytes(raw)
    need = quants.tensor_nbytes(ggml_type, n * k)
    if arr.size < need:
        raise ValueError(f"{quants.type_name(ggml_type)} [{n}, {k}] needs {need} bytes of GGUF data, got {arr.size}")
    arr = arr[:need]
    # the C decoders read F32/F16/BF16 as arrays of that type: keep them naturally aligned
    if arr.ctypes.data % 4:
        arr = arr.copy()
    return arr


def _check_out(out: torch.Tensor, nbytes: int) -> None:
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("out must be a contiguous 1-D uint8 CPU tensor")
    if out.numel() < nbytes:
        raise ValueError(f"out holds {out.numel()} bytes, the compute form needs {nbytes}")
    if out.data_ptr() % ALIGN:
        raise ValueError(f"out must start on a {ALIGN}-byte boundary")


def _rows_ok(t: torch.Tensor, width: int) -> bool:
    """What the lane kernels read or write as raw memory: float32 [rows, width], contiguous."""
    return t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == width and t.is_contiguous()


def _desc(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}"


def _int4_expander():
    """The C library when it can expand our int4 form (its layout checked against torch), else None."""
    lib = native.lib()
    return lib if lib is not None and native.int4_layout_ok() else None


@functools.cache
def bf16_gemm_native() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU's own bf16 instructions. Where it does not (AVX2), it
    emulates them several times slower than a float32 GEMM (bench/RESULTS.md, "CPUs without AVX-512")."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_bf16(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 x2 [M, K] @ bf16 w [N, K].T -> bf16 [M, N], as F.linear gives it. Where bf16 GEMMs are emulated
    the product runs in float32 on exact copies of both (the same sums up to their order), a slice of w's
    rows and of x2's rows at a time, so that the copies stay within 2 x EXPAND_SCRATCH_BYTES."""
    M, K = x2.shape
    if M < F32_GEMM_MIN_ROWS or bf16_gemm_native():
        return F.linear(x2, w)
    N = w.shape[0]
    step = max(1, EXPAND_SCRATCH_BYTES // (4 * K))
    out = torch.empty(M, N, dtype=torch.bfloat16)
    for c0 in range(0, N, step):
        wf = w[c0 : c0 + step].float()
        for r0 in range(0, M, step):
            out[r0 : r0 + step, c0 : c0 + step] = F.linear(x2[r0 : r0 + step].float(), wf)
    return out


# ---------------------------------------------------------------------------------------------------------
# torch/numpy fallbacks: same results as the C path, used when it is unavailable (and by the tests)


def int4_parts_numpy(raw: np.ndarray, ggml_type: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_0/Q4_K bytes -> (q uint8 [n, k] in 0..15, scales_zeros float32 [k/32, n, 2])."""
    if ggml_type == T.Q4_0:
        b = raw.reshape(n * k // 32, 18)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        qs = b[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        scale, zero = d, np.zeros_like(d)
    elif ggml_type == T.Q4_K:
        b = raw.reshape(n * k // 256, 144)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = quants.k_scale_min(b[:, 4:16])
        q = quants.k_nibbles(b[:, 16:])
        scale = d * sc.astype(np.float32)
        # d*sc*q - dmin*m == (q - 8)*scale + (8*scale - dmin*m)
        zero = np.float32(8.0) * scale - dmin * mn.astype(np.float32)
    else:
        raise ValueError(f"{quants.type_name(ggml_type)} has no int4 form")
    sz = np.stack([scale.reshape(n, k // GROUP), zero.reshape(n, k // GROUP)], axis=-1)
    return q.reshape(n, k), np.ascontiguousarray(sz.transpose(1, 0, 2))


def _pack_int4_torch(raw: np.ndarray, ggml_type: int, n: int, k: int, packed: torch.Tensor, sz: torch.Tensor) -> None:
    q, szf = int4_parts_numpy(raw, ggml_type, n, k)
    packed.copy_(torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1))
    sz.copy_(torch.from_numpy(szf))


def _dequant_torch(raw: np.ndarray, ggml_type: int, n: int, k: int, w: torch.Tensor) -> None:
    w.copy_(torch.from_numpy(quants.dequantize(raw, ggml_type, (n, k))))


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even as torch and pack.c do; NaN stays NaN."""
    u = x.view(np.uint32)
    out = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def _dequant_numpy(raw: np.ndarray, ggml_type: int, n: int, k: int, w: torch.Tensor) -> None:
    """GGUF rows -> `w` (bf16 or float32 [n, k]) by the numpy decoders, a slice of rows at a time. Only numpy
    runs here (no torch op), so a reader thread starts no OpenMP team of its own (see pack_int4_rows)."""
    rb = quants.row_nbytes(ggml_type, k)
    step = max(1, DECODE_ROWS_BYTES // (4 * k))
    bf16 = w.dtype == torch.bfloat16
    dst = w.view(torch.int16).numpy().view(np.uint16) if bf16 else w.numpy()
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = quants.dequantize(raw[r0 * rb : r1 * rb], ggml_type, (r1 - r0, k))
        dst[r0:r1] = f32_to_bf16_bits(rows) if bf16 else rows


# ---------------------------------------------------------------------------------------------------------


def pack_into(raw: np.ndarray | memoryview, ggml_type: int, n: int, k: int, out: torch.Tensor, exact: bool) -> QLinear:
    """Fill `out` with the compute form of W [n, k] and return a QLinear whose tensors view `out`.

    `out`: contiguous uint8 CPU tensor, 64-byte aligned start, at least packed_nbytes(...) bytes. Nothing
    else is allocated on the C path, and the GIL is released during the conversion.
    """
    kind = compute_kind(ggml_type, n, k, exact)
    nbytes = packed_nbytes(ggml_type, n, k, exact)
    _check_out(out, nbytes)
    src = _raw_array(raw, ggml_type, n, k)
    lib = native.lib()
    if kind == "lane":
        w = out[:nbytes].view(n, nbytes // n)
        lib.ms_lane_pack(ggml_type, src.ctypes.data, n, k, w.data_ptr())
        return QLinear(n, k, kind, w, ggml_type=ggml_type)
    if kind == "fp8":  # the checkpoint reader made the form (kernels.fp8_pack): a copy
        w = out[:nbytes].view(n, nbytes // n)
        np.copyto(w.numpy().reshape(-1), src)
        return QLinear(n, k, kind, w, ggml_type=ggml_type)
    if kind == "int4":
        n_packed, n_sz = _int4_sizes(n, k)
        packed = out[:n_packed].view(n, k // 2)
        sz = out[n_packed : n_packed + n_sz].view(torch.bfloat16).view(k // GROUP, n, 2)
        _pack_int4(src, ggml_type, n, k, packed, sz)
        return QLinear(n, k, kind, packed, sz)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    w = out[:nbytes].view(dtype).view(n, k)
    if ggml_type in DECODED_TYPES or ggml_type == FP8 and lib is None:
        _dequant_numpy(src, ggml_type, n, k, w)
    elif ggml_type == FP8:
        lib.ms_fp8_unpack(src.ctypes.data, n, k, w.data_ptr(), int(kind == "bf16"))
    elif lib is not None:
        lib.ms_dequant(ggml_type, src.ctypes.data, n * k, w.data_ptr(), int(kind == "bf16"))
    else:
        _dequant_torch(src, ggml_type, n, k, w)
    return QLinear(n, k, kind, w)


def pack_int4_rows(
    raw: np.ndarray | memoryview, ggml_type: int, n: int, k: int, packed: torch.Tensor, sz: torch.Tensor, row0: int
) -> None:
    """Pack W [n, k] as rows row0..row0+n of a bigger int4 weight whose packed rows and scales are given.

    `packed` is this part's own [n, k/2] rows (contiguous); `sz` is the whole weight's bf16 [k/32, N, 2]
    scales, of which this part fills columns row0..row0+n. Used to build one gate|up matrix per expert.
    """
    src = _raw_array(raw, ggml_type, n, k)
    scratch = _SZ_SCRATCH.__dict__.setdefault("by_shape", {})
    part = scratch.get((n, k))
    if part is None:
        part = scratch[(n, k)] = torch.empty(k // GROUP, n, 2, dtype=torch.bfloat16)
    _pack_int4(src, ggml_type, n, k, packed, part)
    # A numpy copy, not torch's: a parallel torch op called from a reader thread starts another OpenMP
    # team there, whose spinning threads then take the cores from every later op of the model's thread.
    sz.view(torch.int16).numpy()[:, row0 : row0 + n] = part.view(torch.int16).numpy()


def _pack_int4(src: np.ndarray, ggml_type: int, n: int, k: int, packed: torch.Tensor, sz: torch.Tensor) -> None:
    """GGUF Q4_0/Q4_K bytes -> torch's int4 layout in `packed` and bf16 scales/zeros in `sz` (C, else torch)."""
    lib = native.lib()
    if lib is not None and native.int4_layout_ok():
        lib.ms_pack_int4(ggml_type, src.ctypes.data, n, k, packed.data_ptr(), sz.data_ptr(), native.int4_block())
    else:
        _pack_int4_torch(src, ggml_type, n, k, packed, sz)


# One scratch per shape and thread for the scales of a part being packed (reader threads pack too).
_SZ_SCRATCH = threading.local()


def from_gguf(raw: np.ndarray | memoryview, ggml_type: int, n: int, k: int, exact: bool) -> QLinear:
    """As pack_into, in memory of its own (dense weights that live for the whole run)."""
    out = aligned_empty(packed_nbytes(ggml_type, n, k, exact))
    return pack_into(raw, ggml_type, n, k, out, exact)


# Rows of one lane_swiglu call at most: bounds the C scratch (act + quantized inputs, ~10 MB for Qwen3-30B).
SWIGLU_MAX_ROWS = 1024


def kernel_scratch_bytes(ubatch: int, top_k: int, hidden: int, ffn: int, max_in: int) -> int:
    """Scratch the matmul kernels hold for a micro-batch of `ubatch` tokens: the bf16 slices of the int4
    expansion, plus the lane kernels' quantized activations and SwiGLU intermediates (one grow-only buffer
    per calling thread in qmm.c, sized by its largest use: a lane_swiglu call of up to SWIGLU_MAX_ROWS rows
    or a dense matmul of `ubatch` rows of up to `max_in` inputs)."""
    expand = EXPAND_SCRATCH_BYTES if ubatch >= INT4_GEMM_MIN_ROWS else 0
    if ubatch >= F32_GEMM_MIN_ROWS and not bf16_gemm_native():  # linear_bf16's float32 copies
        expand += 2 * EXPAND_SCRATCH_BYTES
    if not native.lane_ok():
        return expand
    lib = native.lib()
    swiglu = int(lib.ms_moe_scratch_bytes(min(ubatch * top_k, SWIGLU_MAX_ROWS), hidden, ffn)) if top_k else 0
    lane = max(swiglu, int(lib.ms_qmm_scratch_bytes(ubatch, max_in)))  # top_k 0: a dense model, no experts
    return expand + lane


def decode_on_pool(linears: list[QLinear], min_bytes: int = 1 << 20) -> bool:
    """True when every weight of at least min_bytes is in the lane or fp8 form or bf16 (GEMV_MAX_ROWS rows go to the
    C library's gemv): a decode step of such a model does all its heavy matmuls in the lane pool and leaves
    torch only small ops."""
    return all(lin.kind in ("lane", "bf16", "fp8") for lin in linears if lin.nbytes >= min_bytes)
