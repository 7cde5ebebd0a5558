"""The one executor of routed experts: sum_k w_k * expert_k(x_t) for every token of a forward step's blocks,
each layer's experts fetched once for the union of what all blocks route to and each expert run once on all
the rows routed to it.

Results never depend on which experts were cached or in which order they arrived (streaming must never
change the output): a one-token block sums its experts' outputs in one fixed-order product by expert id once
all are in, a longer block adds each expert's weighted rows in ascending id order (InOrderSum). Experts in the
lane form run in one native call per group the provider hands over, on inputs quantized once for the step
(each row's result is its own, whatever else shares the call); any other expert runs per block, as that
block alone would run it, its activations in the expert's compute dtype.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from moestream.compute import linear
from moestream.compute.experts import ClampedAct, PreparedRows, RowsOf, lane_swiglu
from moestream.models.common import ExpertProvider
from moestream.models.ops import add_weighted_rows
from moestream.models.rows import Spans

# (token, expert) pairs past which a block's experts are fetched in id order and summed as they come: a
# micro-batch's pairs are few, a long span's would otherwise all be held until the last expert arrives
ORDERED_MIN_PAIRS = 1024


def summed_as_they_come(pairs: int) -> bool:
    """Whether a block of this many (token, expert) pairs asks for its experts in order and sums each as it
    comes (ORDERED_MIN_PAIRS): a micro-batch keeps computing cached experts while the misses are read."""
    return pairs > ORDERED_MIN_PAIRS


def run_routed(
    x: torch.Tensor,
    spans: Spans,
    routes: list[tuple[torch.Tensor, torch.Tensor]],
    layer: int,
    experts: ExpertProvider,
    ffn=None,
) -> list[torch.Tensor]:
    """Each block's sum_k w_k * expert_k(x_t) [T_b, hidden] for a step's x [N, hidden] (block b: rows spans[b],
    routes[b] its (weights, ids) [T_b, k]). `ffn` replaces the plain SwiGLU (GPT-OSS's ClampedSwiGLU)."""
    remote = getattr(experts, "remote", None) if ffn is None else None
    if len(spans) == 1 and x.shape[0] == 1:
        return [_one_token(x, *routes[0], layer, experts, ffn, remote)]
    step = _RoutedStep(x, spans, routes, ffn)
    far = remote.held(layer, step.fetch_order) if remote is not None else set()
    # the remote experts' rows go out first, the local experts run while the workers compute theirs
    pending = None
    if far:
        pending = remote.submit(layer, x, {e: [src for _, src, _ in step.runs[e]] for e in sorted(far)}, False)
    step.run_local(experts, layer, [e for e in step.fetch_order if e not in far])
    if pending is not None:
        step.run_local(experts, layer, _take_remote(remote, layer, pending, step.deliver_remote))
    return step.results()


def _one_token(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: int, experts: ExpertProvider, ffn, remote=None
) -> torch.Tensor:
    """A decode step of one sequence: each expert's output written straight into its row (by expert id),
    one fixed-order product once all are in. `remote`: the workers' tier (RemoteExperts), asked first."""
    id_list, w_list = ids[0].tolist(), weights[0].tolist()
    by_id = sorted(range(len(id_list)), key=id_list.__getitem__)
    order = {id_list[p]: r for r, p in enumerate(by_id)}
    w_sorted = torch.tensor([w_list[p] for p in by_id], dtype=x.dtype)
    outs = torch.empty(len(id_list), x.shape[1])
    xc = x.contiguous()
    far = remote.held(layer, id_list) if remote is not None else set()
    one = [np.zeros(1, dtype=np.int64)]
    pending = remote.submit(layer, xc, {e: one for e in sorted(far)}, True) if far else None
    _local_experts(xc, [e for e in id_list if e not in far], layer, experts, ffn, outs, order)
    if pending is not None:
        lost = _take_remote(remote, layer, pending, lambda e, ys: outs.__setitem__(order[e], ys[0][0]))
        _local_experts(xc, lost, layer, experts, ffn, outs, order)
    return (w_sorted @ outs)[None]


def _take_remote(remote, layer: int, pending, deliver) -> list[int]:
    """Each remote expert's outputs handed to deliver(e, ys); the experts whose worker was lost are returned,
    to be computed here from the disk."""
    lost = []
    for e, ys in remote.collect(layer, pending):
        if ys is None:
            lost.append(e)
        else:
            deliver(e, ys)
    return lost


def _local_experts(
    xc: torch.Tensor, ids: list[int], layer: int, experts: ExpertProvider, ffn, outs: torch.Tensor, order: dict
) -> None:
    """One token's experts `ids` fetched from the provider and computed here, each into its row of outs."""
    if not ids:
        return
    for group in experts.fetch_groups(layer, ids):
        if all(w.lane for _, w in group) and lane_takes(ffn):
            lane_swiglu(
                [w for _, w in group], [xc] * len(group), [outs[order[e] : order[e] + 1] for e, _ in group],
                lane_act(ffn, [e for e, _ in group]),
            )  # fmt: skip
            continue
        for e, expert in group:
            xe = xc.to(expert.dtype)
            outs[order[e]] = ffn(e, expert, xe)[0] if ffn is not None else expert.swiglu(xe)[0].float()


def lane_takes(ffn) -> bool:
    """Whether the lane kernel computes this activation: the plain SwiGLU, or an ffn with a `lane` form (an
    activation without one, DeepSeek-V4's clipped SwiGLU, runs per expert in torch)."""
    return ffn is None or hasattr(ffn, "lane")


def lane_act(ffn, ids: list[int]) -> ClampedAct | None:
    """lane_swiglu's `act` for experts `ids`: None for the plain SwiGLU."""
    return None if ffn is None else ffn.lane(ids)


@dataclass
class _Block:
    """How one block's results are summed: one token by a fixed-order product over its experts sorted by id
    (its rows of the step's buffer Y, from `first`), several by adding each expert's weighted rows in id
    order (`summed`)."""

    first: int  # one token: its first row of Y
    weights: torch.Tensor | None  # one token: [k] by expert id
    summed: InOrderSum | None  # several tokens


class _RoutedStep:
    """One layer's routed experts for a step's blocks: which rows each expert runs on (`runs`: expert ->
    (block, its rows of x, its rows of Y for a one-token block)), run group by group as the provider
    delivers them, each output delivered to its block."""

    def __init__(self, x: torch.Tensor, spans: Spans, routes: list[tuple[torch.Tensor, torch.Tensor]], ffn):
        self.x, self.ffn = x, ffn
        self.blocks: list[_Block] = []
        self.runs: dict[int, list[tuple[int, np.ndarray, list[int]]]] = {}
        singles, ordered = 0, False
        for b, ((a, _e), (w, ids)) in enumerate(zip(spans, routes, strict=True)):
            if ids.shape[0] == 1:
                self._one(b, a, w, ids, singles)
                singles += ids.shape[1]
            else:
                ordered = self._several(b, a, w, ids) or ordered
        self.ordered = ordered
        # the union in first-seen order (a one-token block's in its router's order), by id where a long
        # block sums as the experts come
        self.fetch_order = sorted(self.runs) if ordered else list(self.runs)
        self.Y = torch.empty(singles, x.shape[1], dtype=x.dtype)
        self.rows_of = {e: sum(len(src) for _, src, _ in r) for e, r in self.runs.items()}
        self.prepared: PreparedRows | None = None  # x quantized once, when the first lane group comes

    def _one(self, b: int, a: int, w: torch.Tensor, ids: torch.Tensor, first: int) -> None:
        id_list, w_list = ids[0].tolist(), w[0].tolist()
        by_id = sorted(range(len(id_list)), key=id_list.__getitem__)
        self.blocks.append(_Block(first, torch.tensor([w_list[p] for p in by_id], dtype=self.x.dtype), None))
        slot = {p: first + r for r, p in enumerate(by_id)}
        for p, ex in enumerate(id_list):
            self.runs.setdefault(ex, []).append((b, np.array([a]), [slot[p]]))

    def _several(self, b: int, a: int, w: torch.Tensor, ids: torch.Tensor) -> bool:
        """Every (token, slot) pair grouped by expert: expert e's rows are one contiguous range of the sorted
        order, and the block's sum an index_add per expert in id order."""
        T, k = ids.shape
        order = torch.argsort(ids.reshape(-1), stable=True)
        needed_t, counts_t = torch.unique_consecutive(ids.reshape(-1)[order], return_counts=True)
        needed, counts = needed_t.tolist(), counts_t.tolist()
        rows = order // k
        starts = dict(zip(needed, itertools.accumulate([0, *counts[:-1]]), strict=True))
        count = dict(zip(needed, counts, strict=True))
        out = torch.zeros(T, self.x.shape[1], dtype=self.x.dtype)
        summed = InOrderSum(out, needed, rows, w.reshape(-1)[order, None], starts, count)
        self.blocks.append(_Block(0, None, summed))
        src = rows.numpy() + a
        for ex in needed:
            self.runs.setdefault(ex, []).append((b, src[starts[ex] : starts[ex] + count[ex]], []))
        return summed_as_they_come(rows.shape[0])

    def run_local(self, experts: ExpertProvider, layer: int, ids: list[int]) -> None:
        """Experts `ids` (in the fetch order) from the provider, computed here."""
        if ids:
            for group in experts.fetch_groups(layer, ids, ordered=self.ordered):
                self.run(group)

    def run(self, group: list) -> None:
        lane = all(w.lane for _, w in group) and lane_takes(self.ffn)
        for part in row_batches(group, self.rows_of):
            if lane:
                self._lane(part)
            else:
                self._each(part)

    def _lane(self, part: list) -> None:
        """One lane_swiglu call for a part's experts, each on its rows of every block (the step's inputs
        quantized once), each block's slice then delivered."""
        self.prepared = self.prepared or PreparedRows(self.x.contiguous())
        rows = [np.concatenate([src for _, src, _ in self.runs[ex]]) for ex, _ in part]
        sizes = [len(r) for r in rows]
        ys = list(torch.empty(sum(sizes), self.x.shape[1]).split(sizes))  # one allocation for the part
        lane_swiglu([w for _, w in part], RowsOf(self.prepared, rows), ys,
                           lane_act(self.ffn, [ex for ex, _ in part]))  # fmt: skip
        for (ex, _), y in zip(part, ys, strict=True):
            at = 0
            for b, src, dst in self.runs[ex]:
                self._deliver(b, ex, dst, y[at : at + len(src)])
                at += len(src)

    def _each(self, part: list) -> None:
        """Experts the lane kernel does not take: one gather of the part's rows (each torch op wakes its
        thread pool), then each expert on each block's rows alone."""
        srcs = [src for ex, _ in part for _, src, _ in self.runs[ex]]
        gathered = self.x[torch.from_numpy(np.concatenate(srcs))].split([len(s) for s in srcs])
        at = 0
        for ex, expert in part:
            for b, _src, dst in self.runs[ex]:
                xe = gathered[at].to(expert.dtype)
                at += 1
                y = self.ffn(ex, expert, xe) if self.ffn is not None else expert.swiglu(xe).float()
                self._deliver(b, ex, dst, y)

    def deliver_remote(self, ex: int, ys: list[torch.Tensor]) -> None:
        """A worker's outputs of expert ex, one per run of its rows (in runs[ex]'s order)."""
        for (b, _src, dst), y in zip(self.runs[ex], ys, strict=True):
            self._deliver(b, ex, dst, y)

    def _deliver(self, b: int, ex: int, dst: list[int], y: torch.Tensor) -> None:
        blk = self.blocks[b]
        if blk.summed is not None:
            blk.summed.add(ex, y)
        else:
            self.Y[dst] = y

    def results(self) -> list[torch.Tensor]:
        out = []
        for blk in self.blocks:
            if blk.summed is not None:
                out.append(blk.summed.result())
            else:
                assert blk.weights is not None
                out.append((blk.weights @ self.Y[blk.first : blk.first + len(blk.weights)])[None])
        return out


class InOrderSum:
    """sum_k w_k * expert_k(x_t) for each token t, added expert by expert in ascending id order (the order the
    sorted pairs give), however the experts arrive: an expert's weighted rows wait only while an earlier id
    is missing. With the experts yielded in order nothing waits, so a prompt span holds its output and one
    batch of rows, not a row for every (token, expert) pair."""

    def __init__(
        self,
        out: torch.Tensor,
        needed: list[int],
        rows: torch.Tensor,
        weights: torch.Tensor,
        starts: dict[int, int],
        count: dict[int, int],
    ):
        self.out, self.needed, self.rows, self.weights = out, needed, rows, weights
        self.starts, self.count = starts, count
        self.waiting: dict[int, torch.Tensor] = {}
        self.next = 0

    def add(self, e: int, y: torch.Tensor) -> None:
        """Expert e's outputs for its rows of the sorted pairs (held until the earlier ids are in)."""
        self.waiting[e] = y
        while self.next < len(self.needed) and self.needed[self.next] in self.waiting:
            e = self.needed[self.next]
            a, b = self.starts[e], self.starts[e] + self.count[e]
            add_weighted_rows(self.out, self.rows[a:b], self.waiting.pop(e), self.weights[a:b])
            self.next += 1

    def result(self) -> torch.Tensor:
        assert not self.waiting and self.next == len(self.needed), "an expert was never delivered"
        return self.out


def row_batches(group: list, count: dict[int, int]) -> list[list]:
    """A group's experts in consecutive batches of at most SWIGLU_MAX_ROWS rows (an expert with more alone),
    as lane_swiglu splits its calls: the rows gathered for one batch bound the inputs held at once."""
    batches: list[list] = []
    rows = 0
    for item in group:
        n = count[item[0]]
        if not batches or rows + n > linear.SWIGLU_MAX_ROWS:
            batches.append([])
            rows = 0
        batches[-1].append(item)
        rows += n
    return batches
