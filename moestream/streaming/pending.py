"""An expert being read from disk: its three segment reads, and packing each into its slot as it lands.

The model's thread packs what the reader threads read (fetch.Fetch). An expert that is given up
on (a read failed, the forward pass was abandoned) gives back the buffers of the reads nobody took as they
finish, without waiting for them.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from moestream.compute import kernels, linear
from moestream.compute.experts import ExpertWeights, FusedExpert, SplitExpert
from moestream.streaming.reader import Lease


@dataclass(frozen=True)
class Int4Halves:
    """gate and up packed as one int4 matrix in the slot, each half into its rows as its read lands: rows
    [2F, H/2] and scales [H/32, 2F, 2]."""

    rows: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class LaneHalves:
    """gate and up in the lane form, side by side in the slot: one [2F, row bytes] matrix."""

    rows: torch.Tensor


def pack_lanes(jobs: list[tuple[PendingExpert, int, Lease]]) -> None:
    """Pack finished lane-form segments (pending, segment index, its bytes) in one native call, spread over
    the lane pool's threads; the read buffers go back whatever happens."""
    try:
        segs = [p.segs[i] for p, i, _ in jobs]
        rc = kernels.lane_pack_many(
            [(s.ggml_type, s.n, s.k) for s in segs],
            [lease.addr for _, _, lease in jobs],
            [p.lane[i] for p, i, _ in jobs],  # type: ignore[index]
        )
    finally:
        for _, _, lease in jobs:
            lease.release()
    if rc != 0:
        raise RuntimeError(f"ms_lane_pack_many failed ({rc}) for layer {jobs[0][0].layer}")


def _release_when_read(fut: Future) -> None:
    """Done-callback of an abandoned read: its buffer goes back as soon as the read completes."""
    if fut.cancelled() or fut.exception() is not None:
        return
    lease = fut.result()
    if isinstance(lease, Lease):
        lease.release()


class PendingExpert:
    """An expert whose three segments are being read; packed segment by segment as reads complete."""

    def __init__(self, layer, expert, slot, segs, outs, futures, exact, fused=None, lane=None):
        self.layer, self.expert, self.slot = layer, expert, slot
        self.segs, self.outs, self.futures, self.exact = segs, outs, futures, exact
        self.fused: Int4Halves | LaneHalves | None = fused  # gate and up as one matrix in the slot, or not
        # every segment in the lane form: where each one goes in the slot (ExpertLayout.all_lane)
        self.lane: list[int] | None = lane
        self.parts: list[linear.QLinear | torch.Tensor | None] = [None, None, None]
        self.taken: set[int] = set()  # lane-form segments whose lease pack_lanes took (and releases)
        self.left = len(futures)
        self.t0 = time.perf_counter()
        self.abandoned = False

    def pack(self, i: int, raw: memoryview) -> linear.QLinear | torch.Tensor:
        """Segment i's bytes into its place in the slot (any thread: the C packer releases the GIL)."""
        seg = self.segs[i]
        arr = np.frombuffer(raw, dtype=np.uint8)
        if seg.convert is not None:
            arr = seg.convert(arr)
        with torch.inference_mode():  # the slot views were made in inference mode; reader threads are not in it
            return self._pack(i, seg, arr)

    def _pack(self, i: int, seg, arr: np.ndarray) -> linear.QLinear | torch.Tensor:
        if isinstance(self.fused, Int4Halves) and i < 2:
            rows = self.fused.rows[i * seg.n : (i + 1) * seg.n]
            linear.pack_int4_rows(arr, seg.ggml_type, seg.n, seg.k, rows, self.fused.scales, i * seg.n)
            return rows  # a marker: this half is in
        return linear.pack_into(arr, seg.ggml_type, seg.n, seg.k, self.outs[i], self.exact)

    def segment_done(self, fut: Future) -> ExpertWeights | None:
        """Take a finished segment (packing it here if the reader did not); the expert once all are in."""
        if self.lane is not None:
            pack_lanes([self.take(fut)])
            return self.lane_done()
        i = self.futures.index(fut)
        result = fut.result()
        if isinstance(result, Lease):
            try:
                self.parts[i] = self.pack(i, result.view)  # type: ignore[assignment]
            finally:
                result.release()
        else:
            self.parts[i] = result
        self.left -= 1
        if self.left:
            return None
        if isinstance(self.fused, LaneHalves):  # the two halves were packed in place
            seg = self.segs[0]
            gate_up = linear.QLinear(2 * seg.n, seg.k, "lane", self.fused.rows, ggml_type=seg.ggml_type)
            return FusedExpert(gate_up, self.parts[2])  # type: ignore[arg-type]
        if isinstance(self.fused, Int4Halves):
            h = self.fused
            return FusedExpert(linear.QLinear(h.rows.shape[0], self.segs[0].k, "int4", h.rows, h.scales),
                               self.parts[2])  # type: ignore[arg-type]  # fmt: skip
        return SplitExpert(*self.parts)  # type: ignore[arg-type]

    def started(self, futures: list[Future]) -> PendingExpert:
        """Its segment reads are under way: one future per segment, gate, up, down."""
        self.futures, self.left = futures, len(futures)
        return self

    def take(self, fut: Future) -> tuple[PendingExpert, int, Lease]:
        """A finished lane-form segment's read, for pack_lanes: from here the caller releases its lease
        (drain skips it)."""
        i = self.futures.index(fut)
        lease = fut.result()
        self.taken.add(i)
        return self, i, lease

    def lane_done(self) -> ExpertWeights | None:
        """Count one lane-form segment as packed; the expert once all three are."""
        self.left -= 1
        if self.left:
            return None
        g, d = self.segs[0], self.segs[2]
        assert isinstance(self.fused, LaneHalves)
        gate_up = linear.QLinear(2 * g.n, g.k, "lane", self.fused.rows, ggml_type=g.ggml_type)
        return FusedExpert(gate_up, linear.QLinear(d.n, d.k, "lane", self.outs[2], ggml_type=d.ggml_type))

    def finish(self) -> ExpertWeights:
        out = None
        for fut in self.futures:
            out = self.segment_done(fut)
        assert out is not None
        return out

    def drain(self) -> None:
        """Give back the buffers of the reads nobody took: now for those that finished, as they finish for the
        rest. Never waits: a read still waiting for a buffer may get one only once this thread releases
        others (waiting here was a deadlock)."""
        for i, (fut, part) in enumerate(zip(self.futures, self.parts, strict=False)):
            if part is None and i not in self.taken:
                fut.add_done_callback(_release_when_read)

    def latency(self) -> float:
        return time.perf_counter() - self.t0
