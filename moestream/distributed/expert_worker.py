"""One expert worker: a Ray actor that holds its share of a model's routed experts resident and computes them.

It opens the same model file the engine runs (each machine needs the file, or a copy at the same path), packs
its experts into pinned slots of an expert cache exactly as the engine would, and runs each expert with the
engine's own kernels on the rows it is sent. It returns each expert's outputs, never a sum: the engine adds
them in its fixed order, so the output is bit-identical to computing them locally.
"""

from __future__ import annotations

import numpy as np
import torch

from moestream.compute.experts import PreparedRows, RowsOf, lane_swiglu

# One expert's work in a call: (expert id, one int64 index array into the call's rows per block it serves).
# A one-token call has a single row and a single block per expert.
ExpertRows = tuple[int, list[np.ndarray]]


class ExpertWorker:
    """Ray actor body (wrapped by ray.remote where a tier starts it)."""

    def __init__(self, model_path: str, exact: bool, keys: list[tuple[int, int]], threads: int | None = None):
        from moestream.engine.model_file import open_model
        from moestream.streaming.expert_cache import ExpertCache
        from moestream.streaming.reader import ExpertReader

        if threads is not None:
            torch.set_num_threads(threads)
        self.file = open_model(model_path, exact, check_types=False)
        store = self.file.store
        # pin() keeps 2 x threads experts' reads in flight and packs them in order: a buffer for each of their
        # three matrices, or an early expert's last matrix could wait behind later ones holding every buffer
        threads = 4
        self.reader = ExpertReader(store.paths, store.max_segment_nbytes, threads=threads, buffers=3 * 2 * threads)
        self.cache = ExpertCache(store, self.reader, len(keys) + 1)
        self.cache.configure(min_slots=1, read_ahead=False)
        pinned = self.cache.pin(keys)
        if pinned != len(keys):
            raise RuntimeError(f"the expert worker pinned {pinned} of its {len(keys)} experts")
        self.keys = set(keys)
        self.calls = 0

    def ready(self) -> int:
        """How many experts it holds (the tier waits for this before the first step)."""
        return len(self.keys)

    def pid(self) -> int:
        import os

        return os.getpid()

    def compute(self, layer: int, x: np.ndarray, work: list[ExpertRows], single: bool) -> list[list[np.ndarray]]:
        """Each expert's outputs for its rows of x [M, hidden] float32, one array per block, in `work`'s
        order. single: the engine's one-token path (the input row as it is), else its prompt/batch path (the
        rows quantized once, each block's rows of a non-lane expert run alone)."""
        self.calls += 1
        xt = torch.from_numpy(np.array(x))  # Ray hands a read-only view of its object store
        ids = [e for e, _ in work]
        experts = dict(self.cache.fetch(layer, ids))
        out: list[list[np.ndarray]] = []
        lane = [e for e in ids if experts[e].lane]
        lane_out = self._lane(xt, [(e, rows) for e, rows in work if experts[e].lane], experts, single) if lane else {}
        for e, blocks in work:
            if e in lane_out:
                out.append(lane_out[e])
                continue
            expert = experts[e]
            ys = []
            for rows in blocks:
                xe = xt[torch.from_numpy(rows)].to(expert.dtype)
                ys.append(expert.swiglu(xe).float().numpy())
            out.append(ys)
        return out

    def _lane(self, xt: torch.Tensor, work: list[ExpertRows], experts: dict, single: bool) -> dict:
        """The lane-form experts in one native call, as the engine's executor makes it."""
        weights = [experts[e] for e, _ in work]
        rows = [np.concatenate(blocks) for _, blocks in work]
        ys = [torch.empty(len(r), xt.shape[1]) for r in rows]
        if single:
            lane_swiglu(weights, [xt.contiguous()] * len(work), ys)
        else:
            lane_swiglu(weights, RowsOf(PreparedRows(xt.contiguous()), rows), ys)
        done = {}
        for (e, blocks), y in zip(work, ys, strict=True):
            parts = y.split([len(b) for b in blocks])
            done[e] = [p.numpy() for p in parts]
        return done

    def close(self) -> None:
        self.cache.close()
        self.reader.close()
        self.file.close()
