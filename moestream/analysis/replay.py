"""Offline replay of a trace's expert accesses against cache policies and sizes.

The replay runs the live cache's own slot policy (moestream/streaming/slot_policy.py: hits, misses,
admission, eviction among unpinned keys, growth while generating, the read-ahead's reservation), driven by
the trace's requests instead of disk reads, so that `lru` at the engine's slot count gives the hit count the
engine observed, exactly:

* Accesses come in groups, one per `fetch(layer, ids)` call, i.e. one per (step, layer), in request order.
* A trace recorded with the prompt read-ahead on (moestream/streaming/read_ahead.py) replays it: a prompt
  group that asks for nearly all of a layer's experts also admits the next layer's first uncached experts,
  and the next group's first access to one of them is a miss.
* What only the driver decides: when a group needs more slots than exist, the live cache proceeds in waves
  whose order depends on read timing. The replay approximates it: it first releases the group's hits (the
  engine computes those before its second wave), then its earliest placed misses one at a time. Only tiny
  budgets (fewer slots than one prompt micro-batch's experts in one layer) reach this case.

The other policies are eviction orders in policies.py; the accesses and results in accesses.py; the table,
the plot and the parsing of sizes in replay_report.py. Everything is importable from here.

Capacity is global (one pool of `slots`) or per-layer (slots split evenly, the first `slots % layers`
layers taking one more).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from moestream.analysis.accesses import (
    Accesses,
    ReplayResult,
    accesses_from_groups,
    accesses_from_trace,
    live_result,
)
from moestream.analysis.policies import POLICIES, make_pools
from moestream.analysis.replay_report import default_slots, parse_slots, plot_replay, replay_table
from moestream.errors import MoestreamError
from moestream.streaming.read_ahead import ahead_choice, reads_ahead
from moestream.streaming.slot_policy import SlotPolicy

__all__ = [
    "POLICIES",
    "Accesses",
    "Admission",
    "GroupMisses",
    "ReplayResult",
    "accesses_from_groups",
    "accesses_from_trace",
    "default_slots",
    "live_result",
    "parse_slots",
    "plot_replay",
    "replay",
    "replay_many",
    "replay_table",
]


@dataclass(frozen=True)
class Admission:
    prompt: bool = True  # prompt misses are admitted (False: Strata's decode-only admission)
    min_hits: int = 0  # admit a key only once it was accessed this many times before

    @classmethod
    def parse(cls, spec: str, meta: dict[str, Any] | None = None) -> Admission:
        """'engine' (what the recording engine did), 'all', 'decode-only', 'min-hits:N', or a '+' of them."""
        prompt, min_hits = True, 0
        for part in spec.split("+"):
            part = part.strip()
            if part == "engine":
                prompt = bool((meta or {}).get("admit_prompt", True))
            elif part == "all":
                prompt = True
            elif part == "decode-only":
                prompt = False
            elif part.startswith("min-hits"):
                _, _, n = part.partition(":")
                try:
                    min_hits = int(n)
                except ValueError:
                    raise MoestreamError(
                        f"admission {part!r}: write min-hits:N with N a number, e.g. min-hits:2"
                    ) from None
            else:
                raise MoestreamError(
                    f"unknown admission {part!r}; use engine, all, decode-only, min-hits:N or decode-only+min-hits:N"
                )
        return cls(prompt, min_hits)

    def __str__(self) -> str:
        parts = [] if self.prompt else ["decode-only"]
        if self.min_hits:
            parts.append(f"min-hits:{self.min_hits}")
        return "+".join(parts) or "all"


@dataclass
class GroupMisses:
    """One group's reads in a replay: the experts of its layer that the previous group read ahead (all of
    them, asked for or not: the disk read them), and the group's own misses in request order."""

    ahead: list[int]
    missed: list[int]


def _capacities(slots: int, parts: int) -> list[int]:
    base, extra = divmod(slots, parts)
    return [base + (p < extra) for p in range(parts)]


def replay(
    acc: Accesses,
    policy: str,
    slots: int,
    *,
    per_layer: bool = False,
    admission: Admission | str = "engine",
    half_life: float = 64.0,
    pin_fraction: float = 0.5,
    profile: Sequence[tuple[int, int]] | None = None,
    group_misses: list[GroupMisses] | None = None,
) -> ReplayResult:
    """Replay the accesses against one policy and cache size. group_misses, if given, receives each group's
    reads (the prefill forecast times them)."""
    if isinstance(admission, str):
        admission = Admission.parse(admission, acc.meta)
    if slots < 1:
        raise MoestreamError(f"a cache needs at least one slot, got {slots}")
    parts = acc.n_layers if per_layer else 1
    caps = _capacities(slots, parts)
    if per_layer and min(caps) < 1:
        raise MoestreamError(
            f"{slots} slots split over {acc.n_layers} layers leaves a layer without a slot; "
            f"use at least {acc.n_layers} slots or global capacity"
        )
    pools = make_pools(acc, policy, caps, per_layer, half_life=half_life, pin_fraction=pin_fraction, profile=profile)
    belady = policy == "belady"
    # The engine's prompt read-ahead changes what the cache holds, so a trace recorded with it on replays it
    # (Belady, an oracle that admits everything, does not).
    ahead = bool(acc.meta.get("read_ahead")) and not belady and admission.prompt and not admission.min_hits
    # runs of adjacent experts bound how many it reads (read_ahead.ahead_choice); traces before run reads: 1
    run_len = int(acc.meta.get("read_run_len", 1))
    # how far each step may grow the cache (SlotPolicy.begin_step); traces before the rule: no limit
    growth = not (per_layer or belady) and "prompt_slots" in acc.meta and "decode_slots" in acc.meta
    adm = admission if not belady else Admission()
    for sp in pools:
        sp.admission.prompt, sp.admission.min_hits = adm.prompt, adm.min_hits
        if growth:
            sp.growth.prompt_slots, sp.growth.decode_slots = (
                int(acc.meta["prompt_slots"]),
                int(acc.meta["decode_slots"]),
            )
            sp.growth.generating = True
    misses = _Simulation(acc, pools, per_layer, ahead, run_len).run(growth, group_misses)
    sizes = np.diff(acc.starts)
    dec = acc.group_decode
    d_miss = misses[dec]
    decode_bytes = int((d_miss * acc.expert_bytes[acc.group_layer[dec]]).sum())
    return ReplayResult(
        policy=policy,
        slots=slots,
        per_layer=per_layer,
        admission="all" if belady else str(admission),
        decode_hits=int((sizes[dec] - d_miss).sum()),
        decode_misses=int(d_miss.sum()),
        prompt_hits=int((sizes[~dec] - misses[~dec]).sum()),
        prompt_misses=int(misses[~dec].sum()),
        decode_tokens=acc.decode_tokens,
        decode_bytes=decode_bytes,
        miss_hist=np.bincount(d_miss).tolist() if len(d_miss) else [],
    )


class _Simulation:
    """A replay's run over the groups: each pool is the SlotPolicy the live cache runs, driven here by the
    trace's requests instead of reads. Where the live cache would wait for reads (every slot pinned), the
    replay goes on in approximated waves (the module's note)."""

    def __init__(self, acc: Accesses, pools: list[SlotPolicy], per_layer: bool, ahead: bool, run_len: int):
        self.acc, self.pools, self.per_layer = acc, pools, per_layer
        self.ahead, self.run_len = ahead, run_len
        self.keys = acc.keys.tolist()
        self.starts = acc.starts.tolist()
        self.decode = acc.group_decode.tolist()
        self.layer = acc.group_layer.tolist()
        self.step = acc.group_step.tolist()
        self.out = np.zeros(acc.n_groups, np.int64)
        self.read_ahead: dict[int, int] = {}  # keys the previous group read ahead -> their (pinned) slots
        self.ahead_layer = -1
        self.ahead_pool: SlotPolicy | None = None

    def run(self, growth: bool, record: list[GroupMisses] | None) -> np.ndarray:
        for g in range(self.acc.n_groups):
            sp = self.pools[self.layer[g]] if self.per_layer else self.pools[0]
            sp.order.begin(g, self.step[g])
            prompt = not self.decode[g]
            if growth and (g == 0 or self.step[g] != self.step[g - 1]):  # a forward step begins
                # a prompt step's number advanced by the micro-batches it ran (a span: several), a token's by one
                units = 1 if not prompt else max(1, self.step[g] - (self.step[g - 1] if g else 0))
                sp.begin_step(units, prompt)
            self._group(g, sp, prompt, record)
        return self.out

    def _group(self, g: int, sp: SlotPolicy, prompt: bool, record: list[GroupMisses] | None) -> None:
        s, e = self.starts[g], self.starts[g + 1]
        keys = self.keys[s:e]
        prev = self.read_ahead if self.ahead_layer == self.layer[g] else {}
        if not prev and self.ahead_pool is not None:  # read ahead for a layer this group is not: let it go
            for slot in self.read_ahead.values():
                self.ahead_pool.unpin(slot)
        self.read_ahead, self.ahead_layer, self.ahead_pool = {}, -1, None
        req = sp.request(keys, sp.admission.refreshes(prompt), prev, s)
        self.out[g] = len(req.ahead) + len(req.missed)
        if record is not None:
            n = self.acc.n_experts
            record.append(GroupMisses(sorted(k % n for k in prev), [keys[i] % n for i in req.missed]))
        # the read-ahead's keys stay pinned through this group (the engine finishes their reads in it)
        pinned = [*prev.values(), *(slot for _, slot in req.hits)]
        placed = self._place(sp, keys, req.missed, s, prompt, pinned)
        nxt = self.layer[g] + 1
        if self.ahead and prompt and nxt < self.acc.n_layers:
            self._read_ahead(self.pools[nxt] if self.per_layer else sp, keys, nxt, e - 1)
        for slot in (*pinned, *placed):
            sp.unpin(slot)
        sp.admission.count(keys)

    def _place(
        self, sp: SlotPolicy, keys: list[int], missed: list[int], s: int, prompt: bool, pinned: list[int]
    ) -> deque[int]:
        """Place a group's misses in request order; returns the slots still pinned, in placement order.
        `pinned` (the group's hits and what was read ahead for it) is emptied by a first wave."""
        placed: deque[int] = deque()
        for n in missed:
            k, i = keys[n], s + n
            sp.order.on_miss(k, i)
            if k in sp.reserved:  # a statically pinned key loads into its own slot
                sp.unpin(sp.place_profile(k))
                continue
            if not sp.admission.admits(k, prompt, i=i):
                continue  # served from the engine's scratch slots: the cache itself does not change
            slot = sp.take(True)
            while slot is None:
                # Every resident key is pinned: the live cache waits for reads and goes on in waves.
                if pinned:
                    for hit in pinned:
                        sp.unpin(hit)
                    pinned.clear()
                elif placed:
                    sp.unpin(placed.popleft())
                else:
                    raise MoestreamError(f"a cache of {sp.order.capacity} slots cannot serve one expert")
                slot = sp.take(True)
            sp.place(k, slot, i=i)
            placed.append(slot)
        return placed

    def _read_ahead(self, sp: SlotPolicy, keys: list[int], nxt: int, i: int) -> None:
        """A prompt group asking for nearly all of its layer's experts admits the next layer's first uncached
        ones, the next layer's resident keys pinned meanwhile (read_ahead.reads_ahead, ahead_choice)."""
        n = self.acc.n_experts
        if not reads_ahead(len(set(keys)), n, sp.room()):
            return
        layer_keys = list(range(nxt * n, (nxt + 1) * n))
        for x in ahead_choice(sp.hold(layer_keys), n, self.run_len):
            slot = sp.take(True)
            if slot is None:
                break
            k = layer_keys[x]
            sp.order.on_miss(k, i)
            sp.place(k, slot, i=i)
            self.read_ahead[k] = slot
        sp.release_held()
        self.ahead_layer, self.ahead_pool = nxt, sp


def replay_many(
    acc: Accesses,
    policies: Sequence[str],
    slots: Sequence[int],
    *,
    per_layer: bool = False,
    admission: Admission | str = "engine",
    progress: bool = True,
    **kw: Any,
) -> list[ReplayResult]:
    """Every policy at every size (Belady is added if missing: it is the ceiling)."""
    policies = list(dict.fromkeys(policies))
    if "belady" not in policies:
        policies.append("belady")
    jobs = [(p, s) for p in policies for s in sorted(set(slots))]
    out = []
    for p, s in tqdm(jobs, desc="replay", unit="run", disable=not progress, leave=False):
        out.append(replay(acc, p, s, per_layer=per_layer, admission=admission, **kw))
    return out
