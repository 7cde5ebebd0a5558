"""Offline replay of a trace's expert accesses against cache policies and sizes.

The replay reproduces the live cache's semantics (moestream/expert_cache.py) so that `lru` at the
engine's slot count gives the hit count the engine observed, exactly:

* Accesses come in groups, one per `fetch(layer, ids)` call, i.e. one per (step, layer), in request order.
* Within a group, every id already resident is a hit and is pinned for the rest of the group. Then the
  misses, in request order: each takes a free slot if one exists, else evicts the policy's victim among
  the keys that are not pinned, and is admitted and pinned at once (before its read would complete).
* A miss that is not admitted (prompt accesses under `decode-only`, or a key not yet seen often enough
  under `min-hits N`) still needs a slot for the duration of its group, as in the engine: it takes a free
  slot or evicts, and the slot is free again after the group.
* A trace recorded with the prompt read-ahead on (moestream/read_ahead.py) replays it: a prompt group that
  asks for nearly all of a layer's experts also admits the next layer's first uncached experts (the next
  layer's resident keys pinned meanwhile), and the next group's first access to one of them is a miss.
* When a group needs more slots than exist, the live cache proceeds in waves whose order depends on read
  timing. The replay approximates it: it first releases the group's hits (the engine computes those before
  its second wave), then its earliest placed misses one at a time. Only tiny budgets (fewer slots than one
  prompt micro-batch's experts in one layer) reach this case.

Policies (all share the group and pin rules above):

lru        least recently used (the engine's own policy)
fifo       first in, first out (hits do not refresh)
lfu-decay  least frequently used, counts halving every `half_life` forward steps; ties go to the older
s3fifo     S3-FIFO (Yang et al., SOSP'23): 10% probationary FIFO, main FIFO with 2-bit counters, ghost list
pin        static (Strata's first RAM tier): the hottest keys of a profile own every slot but top_k (the
           largest decode fetch), which only stage the current misses (a bigger prompt fetch: in waves).
           Without a profile, the replayed trace's own decode counts rank the keys: an oracle, an upper
           bound for profile pinning. A pinned key is read on its first use (every policy starts from an
           empty cache; the engine would read it at startup instead), then never evicted.
pin+lru    `pin_fraction` of the slots (at most all but top_k) pinned as above, lru for the rest
belady     Belady's MIN with the pins respected, maximizing decode hits: evict first a key whose next access
           is a prompt one (the prompt reloads it at no cost to the decode), else the one whose next access
           is farthest. It admits every miss whatever the admission rule. It is optimal (a ceiling for
           every other policy) whenever each fetch fits in the cache; tests check it against an exhaustive
           search.

Capacity is global (one pool of `slots`) or per-layer (slots split evenly, the first `slots % layers`
layers taking one more).
"""

from __future__ import annotations

import heapq
import math
import os
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moestream.analysis.trace import DECODE, DISK, VRAM
from moestream.errors import MoestreamError
from moestream.streaming.read_ahead import ahead_choice, reads_ahead

POLICIES = ("lru", "fifo", "lfu-decay", "s3fifo", "pin", "pin+lru", "belady")
NEVER = 1 << 62  # next use of a key never used again


# ---- accesses -------------------------------------------------------------------------------------


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


def _next_uses(acc: Accesses) -> tuple[np.ndarray, np.ndarray]:
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


# ---- policies -------------------------------------------------------------------------------------


class Policy:
    """One pool of `capacity` slots. The driver owns the group and pin rules; a policy picks victims."""

    admits = True  # False: misses only stage in a slot for their group and are never kept

    def __init__(self, capacity: int):
        self.capacity = capacity

    def begin(self, g: int, step: int) -> None:  # a group starts
        pass

    def __contains__(self, key: int) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def reserved(self, key: int) -> bool:  # the key owns a slot outside `capacity` (static pinning)
        return False

    def on_hit(self, key: int, i: int) -> None:
        pass

    def on_miss(self, key: int, i: int) -> None:  # every miss, admitted or not
        pass

    def wants(self, key: int, i: int) -> bool:  # the policy's own admission (Belady bypasses)
        return True

    def insert(self, key: int, i: int) -> None:
        raise NotImplementedError

    def evict(self, pinned: set[int]) -> int | None:
        """Remove and return a key not in `pinned`; None if every resident key is pinned."""
        raise NotImplementedError


class LRU(Policy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.od: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __contains__(self, key: int) -> bool:
        return key in self.od

    def __len__(self) -> int:
        return len(self.od)

    def on_hit(self, key: int, i: int) -> None:
        self.od.move_to_end(key)

    def insert(self, key: int, i: int) -> None:
        self.od[key] = None

    def evict(self, pinned: set[int]) -> int | None:
        for key in self.od:  # the engine's _take_slot: the oldest key that is not pinned
            if key not in pinned:
                del self.od[key]
                return key
        return None


class FIFO(LRU):
    def on_hit(self, key: int, i: int) -> None:
        pass


class LFUDecay(Policy):
    """Decayed frequency per key (kept for every key ever seen, resident or not).

    Decay by inflation: an access at step s adds 2**(s / half_life), so older accesses weigh
    relatively less without touching every count; all counts are rescaled when the weights grow large.
    """

    def __init__(self, capacity: int, half_life: float = 64.0):
        super().__init__(capacity)
        self.half_life = half_life
        self.score: dict[int, float] = {}
        self.resident: dict[int, int] = {}  # key -> sequence number of its last access (tie-break)
        self.heap: list[tuple[float, int, int]] = []
        self.weight = 1.0
        self.base_step = 0
        self.seq = 0

    def begin(self, g: int, step: int) -> None:
        self.weight = 2.0 ** ((step - self.base_step) / self.half_life)
        if self.weight > 1e100:  # rescale before the floats overflow; the order of scores is unchanged
            f = self.weight
            self.score = {k: v / f for k, v in self.score.items()}
            self.heap = [(self.score[k], s, k) for k, s in self.resident.items()]
            heapq.heapify(self.heap)
            self.base_step, self.weight = step, 1.0

    def __contains__(self, key: int) -> bool:
        return key in self.resident

    def __len__(self) -> int:
        return len(self.resident)

    def _count(self, key: int) -> float:
        s = self.score.get(key, 0.0) + self.weight
        self.score[key] = s
        self.seq += 1
        return s

    def on_hit(self, key: int, i: int) -> None:
        s = self._count(key)
        self.resident[key] = self.seq
        self._push((s, self.seq, key))

    def _push(self, entry: tuple[float, int, int]) -> None:
        heapq.heappush(self.heap, entry)
        if len(self.heap) > 4 * len(self.resident) + 1024:  # drop stale entries before they pile up
            self.heap = [(self.score[k], s, k) for k, s in self.resident.items()]
            heapq.heapify(self.heap)

    def on_miss(self, key: int, i: int) -> None:
        self._count(key)

    def insert(self, key: int, i: int) -> None:
        self.resident[key] = self.seq
        self._push((self.score[key], self.seq, key))

    def evict(self, pinned: set[int]) -> int | None:
        stash = []
        victim = None
        while self.heap:
            s, seq, key = heapq.heappop(self.heap)
            if self.resident.get(key) != seq or self.score.get(key) != s:
                continue  # stale entry
            if key in pinned:
                stash.append((s, seq, key))
                continue
            victim = key
            del self.resident[key]
            break
        for e in stash:
            heapq.heappush(self.heap, e)
        return victim


class S3FIFO(Policy):
    def __init__(self, capacity: int, small_fraction: float = 0.1):
        super().__init__(capacity)
        self.small_cap = max(1, round(small_fraction * capacity))
        self.ghost_cap = max(1, capacity - self.small_cap)
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def on_hit(self, key: int, i: int) -> None:
        self.freq[key] = min(self.freq[key] + 1, 3)

    def insert(self, key: int, i: int) -> None:
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self.freq[key] = 0

    def _evict_small(self, pinned: set[int]) -> int | None:
        for _ in range(len(self.small)):
            key = next(iter(self.small))
            if key in pinned:
                self.small.move_to_end(key)
            elif self.freq[key] > 1:  # reused while on probation: promote
                del self.small[key]
                self.main[key] = None
            else:
                del self.small[key]
                del self.freq[key]
                self.ghost[key] = None
                if len(self.ghost) > self.ghost_cap:
                    self.ghost.popitem(last=False)
                return key
        return None

    def _evict_main(self, pinned: set[int]) -> int | None:
        for _ in range(4 * len(self.main) + 1):
            if not self.main:
                break
            key = next(iter(self.main))
            if key in pinned:
                self.main.move_to_end(key)
            elif self.freq[key] > 0:
                self.freq[key] -= 1
                self.main.move_to_end(key)
            else:
                del self.main[key]
                del self.freq[key]
                return key
        return None

    def evict(self, pinned: set[int]) -> int | None:
        if len(self.small) >= self.small_cap or not self.main:
            victim = self._evict_small(pinned)
            return victim if victim is not None else self._evict_main(pinned)
        victim = self._evict_main(pinned)
        return victim if victim is not None else self._evict_small(pinned)


class Pinned(Policy):
    """`static` keys own reserved slots: filled on first use, never evicted. `inner` runs the other slots;
    with admit=False nothing else is ever kept there (they only stage misses for the group)."""

    def __init__(self, static: Iterable[int], inner: Policy, admit: bool = True):
        super().__init__(inner.capacity)
        self.static = frozenset(static)
        self.loaded: set[int] = set()
        self.inner = inner
        self.admits = admit

    def begin(self, g: int, step: int) -> None:
        self.inner.begin(g, step)

    def __contains__(self, key: int) -> bool:
        return key in self.loaded or key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def reserved(self, key: int) -> bool:
        return key in self.static

    def on_hit(self, key: int, i: int) -> None:
        if key not in self.static:
            self.inner.on_hit(key, i)

    def on_miss(self, key: int, i: int) -> None:
        self.inner.on_miss(key, i)

    def insert(self, key: int, i: int) -> None:
        if key in self.static:
            self.loaded.add(key)
        else:
            self.inner.insert(key, i)

    def evict(self, pinned: set[int]) -> int | None:
        return self.inner.evict(pinned)


class Belady(Policy):
    def __init__(self, capacity: int, next_any: np.ndarray, next_dec: np.ndarray):
        super().__init__(capacity)
        self.next_any = next_any
        self.next_dec = next_dec
        self.nu: dict[int, tuple[int, int]] = {}  # resident key -> (next decode group, next group)
        self.heap: list[tuple[int, int, int]] = []  # (-next decode, -next any, key): farthest first

    def __contains__(self, key: int) -> bool:
        return key in self.nu

    def __len__(self) -> int:
        return len(self.nu)

    def _set(self, key: int, i: int) -> None:
        nd, na = int(self.next_dec[i]), int(self.next_any[i])
        self.nu[key] = (nd, na)
        heapq.heappush(self.heap, (-nd, -na, key))
        if len(self.heap) > 4 * len(self.nu) + 1024:  # drop stale entries before they pile up
            self.heap = [(-d, -a, k) for k, (d, a) in self.nu.items()]
            heapq.heapify(self.heap)

    on_hit = _set
    insert = _set

    def wants(self, key: int, i: int) -> bool:
        """MIN with bypass: keep the key only if it is needed again sooner than the farthest resident one.

        Misses that are not admitted are served from scratch slots and leave the cache as it was, so the
        optimum may decline them; without bypass an admission rule could beat this 'ceiling'.
        """
        if len(self.nu) < self.capacity:
            return True
        while self.heap and self.nu.get(self.heap[0][2]) != (-self.heap[0][0], -self.heap[0][1]):
            heapq.heappop(self.heap)
        if not self.heap:
            return True
        return (int(self.next_dec[i]), int(self.next_any[i])) < (-self.heap[0][0], -self.heap[0][1])

    def evict(self, pinned: set[int]) -> int | None:
        stash = []
        victim = None
        while self.heap:
            e = heapq.heappop(self.heap)
            key = e[2]
            if self.nu.get(key) != (-e[0], -e[1]):
                continue
            if key in pinned:
                stash.append(e)
                continue
            victim = key
            del self.nu[key]
            break
        for e in stash:
            heapq.heappush(self.heap, e)
        return victim


# ---- the driver -----------------------------------------------------------------------------------


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


def _capacities(slots: int, parts: int) -> list[int]:
    base, extra = divmod(slots, parts)
    return [base + (p < extra) for p in range(parts)]


def _profile_keys(acc: Accesses, profile: Sequence[tuple[int, int]] | None) -> list[int]:
    """Keys ranked hottest first: a given profile's (layer, expert) order, else the trace's decode counts."""
    if profile is not None:
        return [layer * acc.n_experts + e for layer, e in profile]
    gid_decode = np.repeat(acc.group_decode, np.diff(acc.starts))
    keys = acc.keys[gid_decode] if gid_decode.any() else acc.keys
    uniq, counts = np.unique(keys, return_counts=True)
    order = np.lexsort((uniq, -counts))  # most used first, ties by key
    return uniq[order].tolist()


def _make_policies(
    acc: Accesses,
    policy: str,
    caps: list[int],
    per_layer: bool,
    *,
    half_life: float,
    pin_fraction: float,
    profile: Sequence[tuple[int, int]] | None,
) -> list[Policy]:
    if policy == "belady":
        nxt_any, nxt_dec = _next_uses(acc)
        return [Belady(c, nxt_any, nxt_dec) for c in caps]
    if policy in ("pin", "pin+lru"):
        ranked = _profile_keys(acc, profile)
        # Slots left unpinned so that one decode fetch fits at once (a larger prompt fetch goes in waves).
        sizes = np.diff(acc.starts)
        dec = sizes[acc.group_decode]
        reserve = int(dec.max() if len(dec) else sizes.max(initial=1))
        out: list[Policy] = []
        for p, c in enumerate(caps):
            n_pin = max(0, c - reserve)
            if policy == "pin+lru":
                n_pin = min(n_pin, round(pin_fraction * c))
            mine = [k for k in ranked if k // acc.n_experts == p] if per_layer else ranked
            out.append(Pinned(mine[:n_pin], LRU(c - n_pin), admit=policy == "pin+lru"))
        return out
    make = {
        "lru": LRU,
        "fifo": FIFO,
        "s3fifo": S3FIFO,
        "lfu-decay": lambda c: LFUDecay(c, half_life),
    }.get(policy)
    if make is None:
        raise MoestreamError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    return [make(c) for c in caps]


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
) -> ReplayResult:
    """Replay the accesses against one policy and cache size."""
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
    pols = _make_policies(acc, policy, caps, per_layer, half_life=half_life, pin_fraction=pin_fraction, profile=profile)
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
    misses = _simulate(acc, pols, per_layer, admission if not belady else Admission(), ahead, run_len, growth)
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
) -> np.ndarray:
    """Misses per group. ahead: model the engine's prompt read-ahead (moestream.streaming.read_ahead): a prompt group
    asking for nearly all of a layer's experts also admits the next layer's first uncached experts, the
    next layer's resident keys pinned meanwhile; the next group's first access to such a key is a miss.
    growth: (per prompt step, per decode step): how many keys each step may add to the cache beyond the
    limit so far (ExpertCache.begin_step); past it, a miss evicts instead."""
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
            limit = min(pol.capacity, max(limit, len(pol)) + growth[0 if not decode[g] else 1])
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
    from tqdm import tqdm

    out = []
    for p, s in tqdm(jobs, desc="replay", unit="run", disable=not progress, leave=False):
        out.append(replay(acc, p, s, per_layer=per_layer, admission=admission, **kw))
    return out


# ---- output ---------------------------------------------------------------------------------------


def replay_table(results: Sequence[ReplayResult]) -> str:
    """An aligned text table, one row per (policy, size)."""
    head = ("policy", "capacity", "admission", "slots", "decode hit %", "MB/token", "reads/token", "prompt hit %")
    rows = [head]
    for r in results:
        rows.append(
            (
                r.policy,
                r.capacity,
                r.admission,
                str(r.slots),
                f"{100 * r.hit_rate:.2f}",
                f"{r.mb_per_token:.1f}",
                f"{r.misses_per_token:.1f}",
                f"{100 * r.prompt_hit_rate:.2f}" if r.prompt_hits + r.prompt_misses else "-",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[c].ljust(widths[c]) if c < 3 else row[c].rjust(widths[c]) for c in range(len(head))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_replay(
    results: Sequence[ReplayResult], path: str | os.PathLike[str], title: str = "", live: ReplayResult | None = None
) -> None:
    """PNG of decode hit rate vs cache size, one line per policy, Belady dashed as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    series: dict[str, list[ReplayResult]] = {}
    for r in results:
        label = r.policy + (" per-layer" if r.per_layer else "")
        if r.admission != "all":
            label += f" [{r.admission}]"
        series.setdefault(label, []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r.slots)
        x = [r.slots for r in rs]
        y = [100 * r.hit_rate for r in rs]
        if rs[0].policy == "belady":
            ax.plot(x, y, "k--", lw=2, label=f"{label} (ceiling)", zorder=3)
        else:
            ax.plot(x, y, marker="o", ms=4, label=label)
    if live is not None and live.slots:
        ax.plot([live.slots], [100 * live.hit_rate], "r*", ms=14, label="live (engine)", zorder=4)
    xs = sorted({r.slots for r in results})
    if len(xs) > 1 and xs[0] > 0 and xs[-1] / xs[0] >= 4:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 256, not 2^8
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("cache slots (experts)")
    ax.set_ylabel("decode hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "expert cache replay")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    plt.close(fig)


def parse_slots(spec: str, meta: dict[str, Any] | None = None) -> list[int]:
    """'256,512,1024', '256:4096' (powers of two between), 'engine' (the trace's n_slots), or a mix."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if part == "engine":
                n = int((meta or {}).get("n_slots") or 0)
                if n < 1:
                    raise MoestreamError("the trace has no n_slots in its metadata; give sizes with --slots")
                out.append(n)
            elif ":" in part:
                lo, hi = (int(x) for x in part.split(":"))
                if lo < 1 or hi < lo:
                    raise ValueError
                n = lo
                while n <= hi:
                    out.append(n)
                    n *= 2
            else:
                out.append(int(part))
        except ValueError:
            raise MoestreamError(
                f"cannot read slot sizes {spec!r}; write e.g. 256,512,1024 or 256:4096 or engine"
            ) from None
    if not out or min(out) < 1:
        raise MoestreamError(f"slot sizes must be positive numbers, got {spec!r}")
    return sorted(set(out))


def default_slots(acc: Accesses) -> list[int]:
    """Powers of two from one token's experts to every expert, plus the engine's own size."""
    total = acc.n_layers * acc.n_experts
    top_k = int(acc.meta.get("top_k") or max(1, round(len(acc.keys) / max(acc.n_groups, 1))))
    lo = 1 << max(0, math.ceil(math.log2(max(1, acc.n_layers * top_k))))
    out = []
    n = lo
    while n < total:
        out.append(n)
        n *= 2
    out.append(total)
    if acc.meta.get("n_slots"):
        out.append(int(acc.meta["n_slots"]))
    return sorted(set(out))
