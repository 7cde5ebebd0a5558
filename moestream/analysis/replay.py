"""Offline replay of a trace's expert accesses against cache policies and sizes.

The replay reproduces the live cache's semantics (moestream/streaming/expert_cache.py) so that `lru` at the
engine's slot count gives the hit count the engine observed, exactly:

* Accesses come in groups, one per `fetch(layer, ids)` call, i.e. one per (step, layer), in request order.
* Within a group, every id already resident is a hit and is pinned for the rest of the group. Then the
  misses, in request order: each takes a free slot if one exists, else evicts the policy's victim among
  the keys that are not pinned, and is admitted and pinned at once (before its read would complete).
* A miss that is not admitted (prompt accesses under `decode-only`, or a key not yet seen often enough
  under `min-hits N`) still needs a slot for the duration of its group, as in the engine: it takes a free
  slot or evicts, and the slot is free again after the group.
* A trace recorded with the prompt read-ahead on (moestream/streaming/read_ahead.py) replays it: a prompt group that
  asks for nearly all of a layer's experts also admits the next layer's first uncached experts (the next
  layer's resident keys pinned meanwhile), and the next group's first access to one of them is a miss.
* When a group needs more slots than exist, the live cache proceeds in waves whose order depends on read
  timing. The replay approximates it: it first releases the group's hits (the engine computes those before
  its second wave), then its earliest placed misses one at a time. Only tiny budgets (fewer slots than one
  prompt micro-batch's experts in one layer) reach this case.

The policies themselves are in policies.py; the accesses and results in accesses.py; the table, the plot
and the parsing of sizes in replay_report.py. Everything is importable from here.

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
    NEVER,
    Accesses,
    ReplayResult,
    accesses_from_groups,
    accesses_from_trace,
    live_result,
)
from moestream.analysis.policies import POLICIES, Policy, make_policies
from moestream.analysis.replay_report import default_slots, parse_slots, plot_replay, replay_table
from moestream.errors import MoestreamError
from moestream.streaming.read_ahead import ahead_choice, reads_ahead

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
    pols = make_policies(acc, policy, caps, per_layer, half_life=half_life, pin_fraction=pin_fraction, profile=profile)
    belady = policy == "belady"
    # The engine's prompt read-ahead changes what the cache holds, so a trace recorded with it on replays it
    # (Belady, an oracle that admits everything, does not).
    ahead = bool(acc.meta.get("read_ahead")) and not belady and admission.prompt and not admission.min_hits
    # runs of adjacent experts bound how many it reads (read_ahead.ahead_choice); traces before run reads: 1
    run_len = int(acc.meta.get("read_run_len", 1))
    # how far each step may grow the cache (ExpertCache.begin_step); traces before the rule: no limit
    growth = None
    if not (per_layer or belady) and "prompt_slots" in acc.meta and "decode_slots" in acc.meta:
        growth = (int(acc.meta["prompt_slots"]), int(acc.meta["decode_slots"]))
    misses = _simulate(
        acc, pols, per_layer, admission if not belady else Admission(), ahead, run_len, growth, group_misses
    )
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


def _simulate(
    acc: Accesses,
    pols: list[Policy],
    per_layer: bool,
    adm: Admission,
    ahead: bool = False,
    run_len: int = 1,
    growth: tuple[int, int] | None = None,
    record: list[GroupMisses] | None = None,
) -> np.ndarray:
    """Misses per group. ahead: model the engine's prompt read-ahead (moestream.streaming.read_ahead): a prompt group
    asking for nearly all of a layer's experts also admits the next layer's first uncached experts, the
    next layer's resident keys pinned meanwhile; the next group's first access to such a key is a miss.
    growth: (per prompt micro-batch, per decode step): how many keys each step may add to the cache beyond
    the limit so far (ExpertCache.begin_step; a prompt span's step number advances by its micro-batches, and
    its allowance is that many times the per-micro-batch one); past it, a miss evicts instead.
    record: appended each group's GroupMisses."""
    keys = acc.keys.tolist()
    starts = acc.starts.tolist()
    decode = acc.group_decode.tolist()
    layer = acc.group_layer.tolist()
    step = acc.group_step.tolist()
    seen: dict[int, int] = {}
    min_hits = adm.min_hits
    out = np.zeros(acc.n_groups, np.int64)
    read_ahead: set[int] = set()  # keys admitted by the read-ahead, not accessed yet
    ahead_layer = -1
    limit = NEVER if growth is None else 0
    for g in range(acc.n_groups):
        pol = pols[layer[g]] if per_layer else pols[0]
        pol.begin(g, step[g])
        if growth is not None and (g == 0 or step[g] != step[g - 1]):  # a forward step begins
            # a prompt step's number advanced by the micro-batches it ran (a span: several), a token's by one
            units = 1 if decode[g] else max(1, step[g] - (step[g - 1] if g else 0))
            limit = min(pol.capacity, max(limit, len(pol)) + growth[0 if not decode[g] else 1] * units)
        limit = min(limit, pol.capacity)
        s, e = starts[g], starts[g + 1]
        prev = read_ahead if ahead_layer == layer[g] else set()
        read_ahead, ahead_layer = set(), -1
        # the read-ahead's keys stay pinned through this group (the engine finishes their reads in it)
        pinned: set[int] = set(prev)
        miss: list[tuple[int, int]] = []
        refresh = decode[g] or adm.prompt  # a non-admitting prompt path does not refresh recency either
        for i in range(s, e):
            k = keys[i]
            if k in prev:
                out[g] += 1  # read ahead: resident, but read from disk for this access
                if refresh:
                    pol.on_hit(k, i)
            elif k in pol:
                if refresh:
                    pol.on_hit(k, i)
                pinned.add(k)
            else:
                miss.append((k, i))
        out[g] += len(miss)
        if record is not None:
            record.append(GroupMisses(sorted(k % acc.n_experts for k in prev), [k % acc.n_experts for k, _ in miss]))
        if miss:
            admit_phase = decode[g] or adm.prompt
            hits_pinned = set(pinned)
            placed: deque[int | None] = deque()  # in placement order; None = a borrowed slot
            borrowed = 0
            for k, i in miss:
                pol.on_miss(k, i)
                if pol.reserved(k):  # a statically pinned key loads into its own slot
                    pol.insert(k, i)
                    pinned.add(k)
                    continue
                admit = pol.admits and admit_phase and seen.get(k, 0) >= min_hits and pol.wants(k, i)
                if not admit:
                    continue  # served from the engine's scratch slots: the cache itself does not change
                while len(pol) + borrowed >= limit:
                    if pol.evict(pinned) is not None:
                        break
                    # Every resident key is pinned: the live cache waits for reads and goes on in waves.
                    if hits_pinned:
                        pinned -= hits_pinned
                        hits_pinned = set()
                    elif placed:
                        first = placed.popleft()
                        if first is None:
                            borrowed -= 1
                        else:
                            pinned.discard(first)
                    else:
                        raise MoestreamError(f"a cache of {pol.capacity} slots cannot serve one expert")
                if admit:
                    pol.insert(k, i)
                    pinned.add(k)
                    placed.append(k)
                else:
                    borrowed += 1
                    placed.append(None)
        nxt = layer[g] + 1
        if ahead and not decode[g] and nxt < acc.n_layers:
            pol2 = pols[nxt] if per_layer else pol
            limit2 = limit if pol2 is pol else pol2.capacity
            if reads_ahead(len(set(keys[s:e])), acc.n_experts, limit2):
                base = nxt * acc.n_experts
                pins = pinned | {k for k in range(base, base + acc.n_experts) if k in pol2}
                fresh = [k - base for k in range(base, base + acc.n_experts) if k not in pol2 and not pol2.reserved(k)]
                for k in (base + x for x in ahead_choice(fresh, acc.n_experts, run_len)):
                    if len(pol2) >= limit2 and pol2.evict(pins) is None:
                        break
                    pol2.on_miss(k, e - 1)
                    pol2.insert(k, e - 1)
                    pins.add(k)
                    read_ahead.add(k)
                ahead_layer = nxt
        if min_hits:
            for i in range(s, e):
                seen[keys[i]] = seen.get(keys[i], 0) + 1
    return out


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
