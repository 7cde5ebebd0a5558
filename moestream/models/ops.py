"""The small float32 ops every block runs, native where the library and the shapes allow: RMSNorm, the
routers' matmul, weighted row sums; and the thread count torch widens to for its few big ops."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from moestream.compute import kernels
from moestream.errors import ModelFileError

SMALL_OP = 1 << 16  # elements up to which a float32 op goes to the native helpers


# torch's threads for the few big torch ops (a prompt's attention) when the engine otherwise keeps torch at
# one thread so that the lane pool has the cores (engine._torch_threads_for); 0: leave torch alone
WIDE_THREADS = 0


def set_wide_threads(n: int) -> None:
    """The engine's thread count, for wide_torch (0: leave torch's count alone)."""
    global WIDE_THREADS
    WIDE_THREADS = n


@contextmanager
def wide_torch() -> Iterator[None]:
    cur = torch.get_num_threads()
    if WIDE_THREADS <= cur:
        yield
        return
    torch.set_num_threads(WIDE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(cur)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. float32 inputs go to the native loop, spread over the lane pool: a decode
    step's many small norms skip torch's per-call dispatch, which outweighs their arithmetic, a prompt span's
    skip its passes over temporaries; each row has the same bits however many rows come in the call."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or x.shape[-1] == 0:
        raise ModelFileError(
            f"a norm weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]} values; "
            "the model file is broken (its tensor shapes do not match its hyperparameters)"
        )
    if kernels.available() and x.dtype == torch.float32 and weight.dtype == torch.float32:
        return kernels.rms_norm_rows(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_weighted_rows(out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
    """out[rows[i]] += y[i] * w[i] for each i in order (rows: int64 [n], y [n, h], w [n, 1]); the same bits as
    out.index_add_(0, rows, y * w). The native loop runs on the caller's thread: torch's index_add_ wakes its
    thread pool for each call, and a prompt span makes one call per expert of every layer."""
    if (
        kernels.available()
        and out.dtype == y.dtype == w.dtype == torch.float32
        and out.is_contiguous()
        and out.dim() == y.dim() == 2
        and y.shape[1] == out.shape[1]
        and rows.shape == (y.shape[0],)
        and w.numel() == y.shape[0]
    ):
        kernels.add_weighted_rows(out, rows, y, w)
        return
    out.index_add_(0, rows, y * w)


def f32_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T for a float32 w [N, K] (routers: kept exact). A few rows run on the lane pool with the
    weight prefetched (faster than torch on its single thread, the decode setting); more rows go to torch's
    GEMM."""
    if kernels.available() and x.shape[0] <= 4 and x.dtype == torch.float32 and w.is_contiguous():
        return kernels.gemv_f32(x, w)
    return x @ w.T
