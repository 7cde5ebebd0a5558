"""The threads a forward step runs on: torch's (its own pool, for the big torch ops) and the lane kernels'
pool, set for each step by what it holds."""

from __future__ import annotations

import torch

from moestream.compute import native
from moestream.models import ops


class StepThreads:
    def __init__(self, threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        self.threads = threads or torch.get_num_threads()
        native.set_threads(self.threads)  # the lane kernels' own pool
        ops.set_wide_threads(self.threads)
        # Small activations times small weights produce denormals, which the CPU handles far more slowly.
        torch.set_flush_denormal(True)
        self._torch_threads = 0  # set by the first step
        self._spin_us = 0

    def begin_step(self, n_tokens: int, lane_decode: bool) -> None:
        """A step of blocks of up to n_tokens tokens. A decode step whose heavy matmuls all run in the lane
        kernels (lane_decode) gives torch one thread: its idle OpenMP threads spin for a while after each op and
        take the cores the lane pool needs. Prompt steps keep every thread for their big torch ops (attention,
        norms, elementwise)."""
        want = 1 if n_tokens == 1 and native.lane_ok() and lane_decode else self.threads
        if want != self._torch_threads:
            torch.set_num_threads(want)
            self._torch_threads = want
        # the lane pool's idle workers spin between a decode step's back-to-back calls, but not through a
        # prompt micro-batch, whose reader threads need the cores to pack what they read
        spin = 2000 if n_tokens == 1 else 100
        if spin != self._spin_us:
            native.set_spin_us(spin)
            self._spin_us = spin
