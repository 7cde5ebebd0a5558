"""What a replay reads and what it reports.

`Accesses` holds a trace's expert accesses in the order the cache saw them, cut into groups (one
`ExpertCache.fetch(layer, ids)` call each); `ReplayResult` holds one replay's counts, and `live_result`
puts what the recording engine itself observed in the same terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moestream.analysis.trace import DECODE, DISK, VRAM
from moestream.errors import MoestreamError

NEVER = 1 << 62  # next use of a key never used again


@dataclass
class Accesses:
    """A trace's accesses in the order the cache saw them, cut into groups (one fetch call each)."""

    keys: np.ndarray  # int64 layer * n_experts + expert, request order within each group
    starts: np.ndarray  # int64 [n_groups + 1]: group g is keys[starts[g]:starts[g + 1]]
    group_decode: np.ndarray  # bool [n_groups]
    group_layer: np.ndarray  # int64 [n_groups]
    group_step: np.ndarray  # int64 [n_groups]
    n_layers: int
    n_experts: int
    decode_tokens: int
    expert_bytes: np.ndarray  # int64 [n_layers]: bytes one expert of the layer reads from disk
    live_hits: np.ndarray  # bool per access: served from RAM/VRAM when the trace was recorded
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_groups(self) -> int:
        return len(self.starts) - 1


def accesses_from_trace(meta: dict[str, Any], rows: np.ndarray, phases: str = "all") -> Accesses:
    """Order a trace's rows as the cache saw them. phases: 'all' or 'decode' (drop the prompt's accesses).

    Accesses served from VRAM never reach the RAM cache and are left out.
    """
    if phases not in ("all", "decode"):
        raise MoestreamError(f"phases must be 'all' or 'decode', got {phases!r}")
    rows = rows[rows["source"] != VRAM]
    if phases == "decode":
        rows = rows[rows["phase"] == DECODE]
    # The metadata's sizes, unless the rows say otherwise (a key must never collide with another).
    n_layers = max(int(meta.get("layers") or 1), int(rows["layer"].max()) + 1 if len(rows) else 1)
    n_experts = max(int(meta.get("experts") or 1), int(rows["expert"].max()) + 1 if len(rows) else 1)
    # Layers run in ascending order within a forward step, and rank is the request order within a layer.
    order = np.lexsort((rows["rank"], rows["layer"], rows["step"]))
    rows = rows[order]
    step, layer = rows["step"], rows["layer"]
    cut = np.flatnonzero((np.diff(step) != 0) | (np.diff(layer) != 0)) + 1
    starts = np.concatenate([[0], cut, [len(rows)]]).astype(np.int64) if len(rows) else np.zeros(1, np.int64)
    first = starts[:-1]
    keys = layer.astype(np.int64) * n_experts + rows["expert"]
    if len(rows):
        # A key twice in one group would mean the trace does not come from one fetch per (step, layer).
        gid = np.repeat(np.arange(len(first)), np.diff(starts))
        pairs = gid * (n_layers * n_experts) + keys
        if len(np.unique(pairs)) != len(pairs):
            raise MoestreamError("the trace repeats an expert within one (step, layer); is it damaged?")
    expert_bytes = np.zeros(n_layers, np.int64)
    disk = rows["source"] == DISK
    if disk.any():
        np.maximum.at(expert_bytes, rows["layer"][disk], rows["bytes"][disk])
    missing = expert_bytes == 0
    if missing.any():
        expert_bytes[missing] = int(meta.get("expert_bytes") or expert_bytes.max() or 0)
    decode_steps = np.unique(step[rows["phase"] == DECODE])
    return Accesses(
        keys=keys,
        starts=starts,
        group_decode=rows["phase"][first] == DECODE,
        group_layer=layer[first].astype(np.int64),
        group_step=step[first].astype(np.int64),
        n_layers=n_layers,
        n_experts=n_experts,
        decode_tokens=len(decode_steps),
        expert_bytes=expert_bytes,
        live_hits=rows["source"] != DISK,
        meta=dict(meta),
    )


def accesses_from_groups(
    groups: Sequence[Sequence[int]],
    decode: Sequence[bool] | None = None,
    layers: Sequence[int] | None = None,
    n_experts: int = 1 << 20,
    expert_bytes: int = 1,
) -> Accesses:
    """Accesses from plain key lists (tests, synthetic workloads). Each group is one fetch; keys are
    layer * n_experts + expert; one step per group unless several groups share a step via `layers`."""
    n = len(groups)
    decode = [True] * n if decode is None else list(decode)
    layers = [0] * n if layers is None else list(layers)
    starts = np.zeros(n + 1, np.int64)
    starts[1:] = np.cumsum([len(g) for g in groups])
    keys = np.array([k for g in groups for k in g], np.int64)
    n_layers = max(layers, default=0) + 1
    step = np.zeros(n, np.int64)
    for g in range(1, n):  # a new step whenever the layer does not increase
        step[g] = step[g - 1] + (layers[g] <= layers[g - 1])
    return Accesses(
        keys=keys,
        starts=starts,
        group_decode=np.array(decode, bool),
        group_layer=np.array(layers, np.int64),
        group_step=step,
        n_layers=n_layers,
        n_experts=n_experts,
        decode_tokens=len(set(step[np.array(decode, bool)].tolist())) if n else 0,
        expert_bytes=np.full(n_layers, expert_bytes, np.int64),
        live_hits=np.zeros(len(keys), bool),
    )


def next_uses(acc: Accesses) -> tuple[np.ndarray, np.ndarray]:
    """For each access: the group of the key's next access, and that group again if it is a decode one."""
    n = len(acc.keys)
    nxt_any = np.full(n, NEVER, np.int64)
    nxt_dec = np.full(n, NEVER, np.int64)
    if n < 2:
        return nxt_any, nxt_dec
    gid = np.repeat(np.arange(acc.n_groups, dtype=np.int64), np.diff(acc.starts))
    order = np.lexsort((np.arange(n), acc.keys))  # by key, then time
    k, g = acc.keys[order], gid[order]
    same = k[1:] == k[:-1]
    nxt_any[order[:-1][same]] = g[1:][same]
    # Keeping a key until its next access only pays if that access is a decode one: a prompt access
    # reloads it at no cost to the decode, so a key whose next access is a prompt one goes first.
    nxt_dec[order[:-1][same]] = np.where(acc.group_decode[g[1:][same]], g[1:][same], NEVER)
    return nxt_any, nxt_dec


# ---- results --------------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    policy: str
    slots: int
    per_layer: bool
    admission: str
    decode_hits: int
    decode_misses: int
    prompt_hits: int
    prompt_misses: int
    decode_tokens: int
    decode_bytes: int
    # decode groups by number of misses: miss_hist[m] groups missed m experts (the forecast's input)
    miss_hist: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        n = self.decode_hits + self.decode_misses
        return self.decode_hits / n if n else 0.0

    @property
    def prompt_hit_rate(self) -> float:
        n = self.prompt_hits + self.prompt_misses
        return self.prompt_hits / n if n else 0.0

    @property
    def hits(self) -> int:
        return self.decode_hits + self.prompt_hits

    @property
    def mb_per_token(self) -> float:
        return self.decode_bytes / 1e6 / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def misses_per_token(self) -> float:
        return self.decode_misses / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def capacity(self) -> str:
        return "per-layer" if self.per_layer else "global"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, prompt_hit_rate=self.prompt_hit_rate, mb_per_token=self.mb_per_token)
        return d


def live_result(acc: Accesses) -> ReplayResult:
    """What the engine observed while recording (from each row's source), in the replay's terms."""
    gid = np.repeat(np.arange(acc.n_groups), np.diff(acc.starts))
    dec = acc.group_decode[gid]
    hit = acc.live_hits
    d_miss_g = np.bincount(gid[dec & ~hit], minlength=acc.n_groups)[acc.group_decode]
    d_bytes = int((d_miss_g * acc.expert_bytes[acc.group_layer[acc.group_decode]]).sum())
    return ReplayResult(
        policy="live",
        slots=int(acc.meta.get("n_slots") or 0),
        per_layer=False,
        admission="all" if acc.meta.get("admit_prompt", True) else "decode-only",
        decode_hits=int((dec & hit).sum()),
        decode_misses=int((dec & ~hit).sum()),
        prompt_hits=int((~dec & hit).sum()),
        prompt_misses=int((~dec & ~hit).sum()),
        decode_tokens=acc.decode_tokens,
        decode_bytes=d_bytes,
        miss_hist=np.bincount(d_miss_g).tolist() if len(d_miss_g) else [],
    )
