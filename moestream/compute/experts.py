"""A routed expert's weights, one class per form the cache packs them in, and the native SwiGLU that runs
several lane-form experts in one call.

An expert is down(act(gate(x), up(x))): gate and up either as one matrix [2F, H] (`FusedExpert`: the int4
form or the lane form, packed side by side in the slot) or as two (`SplitExpert`: float and bf16 files, and
every form the fused layout does not take). Experts whose matrices are all in the lane form go through
`lane_swiglu`, many at a time; any other runs through its QLinear matmuls.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from moestream.compute import native
from moestream.compute.linear import SWIGLU_MAX_ROWS, QLinear, _desc, _rows_ok
from moestream.errors import ComputeError


class ExpertWeights:
    """What the MoE executor asks of an expert, whatever its form."""

    down: QLinear
    lane: bool = False  # all matrices in the lane form: lane_swiglu takes it

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its inputs are computed in."""
        raise NotImplementedError

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate(x), up(x)) for x in the expert's compute dtype."""
        raise NotImplementedError

    def matrices(self) -> tuple[QLinear, ...]:
        """Its matrices, in the order the slot holds them."""
        raise NotImplementedError

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), x in the expert's compute dtype."""
        a, b = self.gate_up(x)
        return self.down.mm((F.silu(a) * b).to(self.down.dtype))


@dataclass(frozen=True, eq=False)
class FusedExpert(ExpertWeights):
    """gate and up as one matrix [2F, H] (gate rows, then up rows), and down."""

    fused: QLinear
    down: QLinear

    @property
    def lane(self) -> bool:  # type: ignore[override]
        return self.fused.kind == "lane" and self.down.kind == "lane"

    @property
    def dtype(self) -> torch.dtype:
        return self.fused.dtype

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.fused.mm(x).chunk(2, dim=-1)
        return a, b

    def matrices(self) -> tuple[QLinear, ...]:
        return self.fused, self.down


@dataclass(frozen=True, eq=False)
class SplitExpert(ExpertWeights):
    """gate, up and down as three matrices."""

    gate: QLinear
    up: QLinear
    down: QLinear

    @property
    def dtype(self) -> torch.dtype:
        return self.gate.dtype

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate.mm(x), self.up.mm(x)

    def matrices(self) -> tuple[QLinear, ...]:
        return self.gate, self.up, self.down


@dataclass(frozen=True)
class ClampedAct:
    """GPT-OSS's expert activation for lane_swiglu: per-expert biases (float32, contiguous; gate and up [F],
    down [hidden]) and down(g * sigmoid(alpha * g) * (u + 1)) with g = min(gate + b, limit) and
    u = clamp(up + b, -limit, limit)."""

    biases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (gate, up, down) of each expert
    alpha: float
    limit: float
    up_shift: float = 1.0  # added to the clamped up: GPT-OSS's 1; DeepSeek-V4's clipped SwiGLU 0 (alpha 1)


class PreparedRows:
    """x float32 [T, H] quantized once, as the lane kernels read their inputs (every token once, however many
    experts it routes to); RowsOf picks an expert's rows of it."""

    def __init__(self, x: torch.Tensor):
        if not _rows_ok(x, x.shape[-1]) or x.shape[-1] % 32:
            raise ComputeError(f"rows to prepare must be float32 [T, H] contiguous, H a multiple of 32: {_desc(x)}")
        lib = native.lib()
        self.n, self.hidden = x.shape
        nbytes = int(lib.ms_qmm_scratch_bytes(self.n, self.hidden))
        self._buf = torch.empty(nbytes + 64, dtype=torch.uint8)
        self.addr = (self._buf.data_ptr() + 63) // 64 * 64  # the C side binds its arrays from a 64-byte boundary
        lib.ms_prep_rows(x.data_ptr(), self.n, self.hidden, self.addr)


@dataclass(frozen=True)
class RowsOf:
    """Experts' inputs taken from prepared rows: expert i's rows are rows[i] (int64 indices into prep's T),
    copied from their one quantization by the native call instead of gathered and quantized per expert."""

    prep: PreparedRows
    rows: list[np.ndarray]


def lane_swiglu(
    experts: list[FusedExpert],
    xs: list[torch.Tensor] | RowsOf,
    outs: list[torch.Tensor],
    act: ClampedAct | None = None,
) -> None:
    """outs[i] = down(silu(gate(xs[i])) * up(xs[i])) for several lane-form experts in one native call.

    xs[i]: float32 [m_i, H] contiguous (the same tensor may be given for several experts), or RowsOf (expert
    i's inputs are rows of one prepared tensor); outs[i]: float32 [m_i, H] contiguous, written. All experts' gate/up
    rows run as one parallel pass, then all down rows: one call per group of experts instead of three kernel
    calls per expert. Groups with more than SWIGLU_MAX_ROWS rows in all are split (bounded scratch). `act`
    (one bias triple per expert) replaces the plain SwiGLU by GPT-OSS's clamped one.
    """
    n = len(experts)
    gather = isinstance(xs, RowsOf)
    counts = [len(r) for r in xs.rows] if gather else [x.shape[0] for x in xs]
    hidden, ffn = (xs.prep.hidden if gather else xs[0].shape[1]), experts[0].down.in_features
    if gather and len(xs.rows) != n:
        raise ComputeError(f"lane_swiglu: {len(xs.rows)} row lists for {n} experts")
    if act is not None:
        _check_biases(act, n, hidden, ffn)
    lib = native.lib()
    i = 0
    while i < n:
        j, rows = i, 0
        while j < n and (j == i or rows + counts[j] <= SWIGLU_MAX_ROWS):
            rows += counts[j]
            j += 1
        c = j - i
        group = experts[i:j]
        _check_group(group, counts[i:j], outs[i:j], None if gather else xs[i:j], hidden, ffn)
        weights = (
            c,
            (ctypes.c_int * c)(*(e.fused.ggml_type for e in group)),
            (ctypes.c_void_p * c)(*(e.fused.weight.data_ptr() for e in group)),
            (ctypes.c_int * c)(*(e.down.ggml_type for e in group)),
            (ctypes.c_void_p * c)(*(e.down.weight.data_ptr() for e in group)),
            hidden,
            ffn,
        )
        counted = ((ctypes.c_int64 * c)(*counts[i:j]), (ctypes.c_void_p * c)(*(o.data_ptr() for o in outs[i:j])))
        bias = (None, None, None, 0.0, 0.0, 0.0)
        if act is not None:
            part = act.biases[i:j]
            ptrs = tuple((ctypes.c_void_p * c)(*(b[p].data_ptr() for b in part)) for p in range(3))
            bias = (*ptrs, act.alpha, act.limit, act.up_shift)
        if gather:
            idx = np.ascontiguousarray(np.concatenate(xs.rows[i:j]), dtype=np.int64)
            lib.ms_moe_ffn_gather(*weights, xs.prep.addr, xs.prep.n, idx.ctypes.data, *counted, *bias)
        else:
            inputs = (ctypes.c_void_p * c)(*(x.data_ptr() for x in xs[i:j]))
            if act is None:
                lib.ms_moe_ffn(*weights, inputs, *counted)
            else:
                lib.ms_moe_ffn_clamped(*weights, inputs, *counted, *bias)
        i = j


def _check_group(
    group: list[FusedExpert],
    counts: list[int],
    outs: list[torch.Tensor],
    xs: list[torch.Tensor] | None,
    hidden: int,
    ffn: int,
) -> None:
    """What the native call reads as raw memory: each expert's shapes, each output's and input's rows."""
    for e, m, o in zip(group, counts, outs, strict=True):
        if e.fused.shape != (2 * ffn, hidden) or e.down.shape != (hidden, ffn):
            raise ComputeError(f"experts {e.fused.shape} and {e.down.shape} for hidden {hidden}, ffn {ffn}")
        if not _rows_ok(o, hidden) or o.shape[0] != m:
            raise ComputeError(f"lane_swiglu: an output {_desc(o)} for {m} rows of hidden size {hidden}")
    for x in xs or []:
        if not _rows_ok(x, hidden):
            raise ComputeError(f"lane_swiglu: an input {_desc(x)} for hidden size {hidden}")


def _check_biases(act: ClampedAct, n: int, hidden: int, ffn: int) -> None:
    """What ms_moe_ffn_clamped reads as raw memory: one float32 contiguous (gate [F], up [F], down [H]) each."""
    if len(act.biases) != n:
        raise ComputeError(f"lane_swiglu: {len(act.biases)} bias triples for {n} experts")
    for triple in act.biases:
        for b, width in zip(triple, (ffn, ffn, hidden), strict=True):
            if b.dtype != torch.float32 or b.shape != (width,) or not b.is_contiguous():
                raise ComputeError(f"lane_swiglu: a bias {_desc(b)} where float32 ({width},) is needed")
