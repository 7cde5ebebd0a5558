"""Where every routed expert lives in the model file.

In a GGUF, `blk.L.ffn_{gate,up,down}_exps.weight` are 3-D tensors [E, rows, cols]; expert e of layer L is
the e-th contiguous slice of each of the three. Older Mixtral files (llama arch) hold one 2-D tensor per
expert instead, `blk.L.ffn_{gate,up,down}.E.weight`, wherever the writer put them: then consecutive experts
are not adjacent in the file and run reads take one expert each (run_len 1). The store turns
(layer, expert) into three byte ranges, and says how many bytes the expert takes once packed into the form
the kernels compute from.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moestream.compute import linear
from moestream.errors import ModelFileError
from moestream.formats.gguf_file import TensorInfo
from moestream.formats.gguf_model import GGUFModel
from moestream.streaming.reader import run_length

# one tensor per expert (older llama-arch Mixtral files): blk.L.ffn_gate.E.weight
PER_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")


def is_routed_expert_tensor(name: str) -> bool:
    """True for the tensors the cache streams (never resident): merged `*_exps` or per-expert ones. Expert
    biases (GPT-OSS's `ffn_*_exps.bias`, [E, rows] float32) are small and stay resident with the model."""
    if "_exps." in name:
        return not name.endswith(".bias")
    return PER_EXPERT_TENSOR.fullmatch(name) is not None


@dataclass(frozen=True)
class Segment:
    """One of an expert's three matrices: W [n, k] stored as GGUF blocks at offset `offset` of file `part`
    (a split model's parts are separate files: a read never spans two)."""

    offset: int
    nbytes: int
    ggml_type: int
    n: int
    k: int
    part: int = 0
    # a checkpoint's tensor that llama.cpp's converter would change (formats/checkpoint.py): the bytes read ->
    # the GGUF bytes of ggml_type [n, k], applied on every fill before packing
    convert: Callable | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ExpertLayout:
    """Shape and type of one layer's experts; every expert of the layer shares it."""

    gate: tuple[int, int, int]  # (ggml_type, n, k)
    up: tuple[int, int, int]
    down: tuple[int, int, int]
    packed: tuple[int, int, int]  # bytes of each matrix in compute form, in gate/up/down order
    # gate and up packed as one matrix [2F, H] (int4 or lane form): one kernel call instead of two per expert
    fused_gate_up: bool = False
    gate_kind: str = ""  # compute form of gate (and up, when fused): linear.compute_kind
    # gate|up fused and down all in the lane form: the cache packs straight from the read buffer (a bare C
    # call per segment, no per-segment tensors: ~30 us of Python each, on every miss)
    all_lane: bool = False

    @property
    def packed_nbytes(self) -> int:
        return sum(self.packed)

    @property
    def offsets(self) -> tuple[int, int, int]:
        """Where gate, up and down start in a slot: one after another, each on a 64-byte boundary."""
        out, off = [], 0
        for size in self.packed:
            out.append(off)
            off += (size + 63) // 64 * 64
        return tuple(out)  # type: ignore[return-value]


PROJECTIONS = ("gate", "up", "down")


class ExpertStore:
    def __init__(self, gguf: GGUFModel | Any, n_layers: int, n_experts: int, exact: bool, first_block: int = 0):
        """Expert layer L is block first_block + L: where the leading blocks are dense FFNs (DeepSeek), the
        engine and the cache number only the MoE layers."""
        self.path = gguf.path
        self.paths = list(gguf.paths)  # the model's files: Segment.part indexes them
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.exact = exact
        self._base: list[tuple[Segment, Segment, Segment]] = []  # expert 0's segments per layer
        # per-expert files: every expert's own segments, per layer (None where the layer's tensors are merged)
        self._split: list[list[tuple[Segment, Segment, Segment]] | None] = []
        self.layouts: list[ExpertLayout] = []
        for layer in range(n_layers):
            block = first_block + layer
            per_expert = f"blk.{block}.ffn_gate.0.weight" in gguf.tensors
            if f"blk.{block}.ffn_gate_exps.weight" in gguf.tensors or not per_expert:
                segs = [self._merged_segment(gguf, block, proj) for proj in PROJECTIONS]
                self._split.append(None)
            else:
                split = [tuple(self._expert_segment(gguf, block, proj, e) for proj in PROJECTIONS)
                         for e in range(n_experts)]  # fmt: skip
                self._split.append(split)  # type: ignore[arg-type]
                segs = list(split[0])
            self._base.append(tuple(segs))
            g, u = segs[0], segs[1]
            kind = linear.compute_kind(g.ggml_type, g.n, g.k, exact)
            packed_gate = linear.packed_nbytes(g.ggml_type, g.n, g.k, exact)
            # lane rows are independent, so gate rows followed by up rows is already one matrix [2F, H]
            # (the up half must start where the slot layout puts it: 64-byte steps)
            fused = (
                g.ggml_type == u.ggml_type
                and (g.n, g.k) == (u.n, u.k)
                and (kind == "int4" or (kind == "lane" and packed_gate % 64 == 0))
            )
            self.layouts.append(
                ExpertLayout(
                    *((s.ggml_type, s.n, s.k) for s in segs),
                    packed=tuple(linear.packed_nbytes(s.ggml_type, s.n, s.k, exact) for s in segs),
                    fused_gate_up=fused,
                    gate_kind=kind,
                    all_lane=fused
                    and not any(s.convert for s in segs)  # the lane packer reads the file's bytes as they are
                    and kind == "lane"
                    and linear.compute_kind(segs[2].ggml_type, segs[2].n, segs[2].k, exact) == "lane",
                )
            )
        # A slot holds any layer's expert, so it is sized for the largest (Q4_K_M mixes Q4_K and Q6_K downs); a
        # dense model (no expert layers) has slots of 0 bytes, and the planner gives it none
        self.slot_nbytes = _round_up(max((lay.packed_nbytes + 3 * 64 for lay in self.layouts), default=0), 4096)
        self.max_segment_nbytes = max((s.nbytes for segs in self._base for s in segs), default=0)
        self.expert_file_nbytes = [sum(s.nbytes for s in segs) for segs in self._base]
        # experts e and e+1 of a layer lie back to back in each merged tensor: a prompt reads runs of them
        self.run_len = run_length(self.max_segment_nbytes, n_experts) if not any(self._split) else 1

    def _merged_segment(self, gguf: GGUFModel, block: int, proj: str) -> Segment:
        """Expert 0's slice of a merged [E, rows, cols] tensor."""
        info = gguf.tensor(f"blk.{block}.ffn_{proj}_exps.weight")
        if len(info.shape) != 3 or info.shape[0] != self.n_experts:
            raise ModelFileError(
                f"{gguf.path}: {info.name} has shape {info.shape}, expected [{self.n_experts}, rows, cols]"
            )
        seg_nbytes = info.nbytes // self.n_experts
        return Segment(info.offset, seg_nbytes, info.ggml_type, info.shape[1], info.shape[2], info.part)

    def _expert_segment(self, gguf: GGUFModel, block: int, proj: str, expert: int) -> Segment:
        """One expert's own 2-D tensor; every expert of the layer must match expert 0's type and shape."""
        info: TensorInfo = gguf.tensor(f"blk.{block}.ffn_{proj}.{expert}.weight")
        first = gguf.tensor(f"blk.{block}.ffn_{proj}.0.weight")
        if len(info.shape) != 2 or (info.shape, info.ggml_type) != (first.shape, first.ggml_type):
            raise ModelFileError(
                f"{gguf.path}: {info.name} has shape {info.shape} ({info.type_name}), unlike {first.name} "
                f"{first.shape} ({first.type_name}); every expert of a layer must have the same shape and type"
            )
        convert = getattr(gguf, "convert_of", lambda _: None)(info.name)
        return Segment(info.offset, info.nbytes, info.ggml_type, info.shape[0], info.shape[1], info.part, convert)

    def segments(self, layer: int, expert: int) -> tuple[Segment, Segment, Segment]:
        split = self._split[layer]
        if split is not None:
            return split[expert]
        out = []
        for s in self._base[layer]:
            out.append(Segment(s.offset + expert * s.nbytes, s.nbytes, s.ggml_type, s.n, s.k, s.part))
        return tuple(out)  # type: ignore[return-value]

    @property
    def total_file_nbytes(self) -> int:
        return sum(self.expert_file_nbytes) * self.n_experts


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a
