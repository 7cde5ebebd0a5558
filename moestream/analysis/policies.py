"""Cache policies for the replay: each is an eviction order (moestream/streaming/slot_policy.py) that picks
victims in one pool of slots; the slot policy the live cache itself runs owns the group, pin and admission
rules they all share.

lru        least recently used (the engine's own policy: slot_policy.LRU)
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
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from moestream.analysis.accesses import Accesses, next_uses
from moestream.errors import MoestreamError
from moestream.streaming.slot_policy import LRU, EvictionOrder, SlotPolicy

POLICIES = ("lru", "fifo", "lfu-decay", "s3fifo", "pin", "pin+lru", "belady")


def pop_unpinned(heap: list[tuple], current: Callable[[tuple], bool], pinned: set[int]) -> tuple | None:
    """Pop the smallest entry of a lazily updated heap whose key (entry[2]) is not pinned.

    Entries that `current` rejects are stale (the key was updated or evicted since) and are dropped;
    pinned ones go back on the heap. None if every current entry is pinned."""
    stash = []
    found = None
    while heap:
        entry = heapq.heappop(heap)
        if not current(entry):
            continue
        if entry[2] in pinned:
            stash.append(entry)
            continue
        found = entry
        break
    for entry in stash:
        heapq.heappush(heap, entry)
    return found


class FIFO(LRU):
    def on_hit(self, key: int, i: int) -> None:
        pass


class LFUDecay(EvictionOrder):
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

    def _current(self, entry: tuple[float, int, int]) -> bool:
        s, seq, key = entry
        return self.resident.get(key) == seq and self.score.get(key) == s

    def evict(self, pinned: set[int]) -> int | None:
        entry = pop_unpinned(self.heap, self._current, pinned)
        if entry is None:
            return None
        del self.resident[entry[2]]
        return entry[2]


class S3FIFO(EvictionOrder):
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


class Belady(EvictionOrder):
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
        while self.heap and not self._current(self.heap[0]):
            heapq.heappop(self.heap)
        if not self.heap:
            return True
        return (int(self.next_dec[i]), int(self.next_any[i])) < (-self.heap[0][0], -self.heap[0][1])

    def _current(self, entry: tuple[int, int, int]) -> bool:
        return self.nu.get(entry[2]) == (-entry[0], -entry[1])

    def evict(self, pinned: set[int]) -> int | None:
        entry = pop_unpinned(self.heap, self._current, pinned)
        if entry is None:
            return None
        del self.nu[entry[2]]
        return entry[2]


# ---- building them --------------------------------------------------------------------------------


def profile_keys(acc: Accesses, profile: Sequence[tuple[int, int]] | None) -> list[int]:
    """Keys ranked hottest first: a given profile's (layer, expert) order, else the trace's decode counts."""
    if profile is not None:
        return [layer * acc.n_experts + e for layer, e in profile]
    gid_decode = np.repeat(acc.group_decode, np.diff(acc.starts))
    keys = acc.keys[gid_decode] if gid_decode.any() else acc.keys
    uniq, counts = np.unique(keys, return_counts=True)
    order = np.lexsort((uniq, -counts))  # most used first, ties by key
    return uniq[order].tolist()


def make_pools(
    acc: Accesses,
    policy: str,
    caps: list[int],
    per_layer: bool,
    *,
    half_life: float,
    pin_fraction: float,
    profile: Sequence[tuple[int, int]] | None,
) -> list[SlotPolicy]:
    """One SlotPolicy per pool of slots (one per layer, or one for all), each with the policy's order."""
    if policy in ("pin", "pin+lru"):
        ranked = profile_keys(acc, profile)
        # Slots left unpinned so that one decode fetch fits at once (a larger prompt fetch goes in waves).
        sizes = np.diff(acc.starts)
        dec = sizes[acc.group_decode]
        reserve = int(dec.max() if len(dec) else sizes.max(initial=1))
        out: list[SlotPolicy] = []
        for p, c in enumerate(caps):
            n_pin = max(0, c - reserve)
            if policy == "pin+lru":
                n_pin = min(n_pin, round(pin_fraction * c))
            mine = [k for k in ranked if k // acc.n_experts == p] if per_layer else ranked
            # the pinned keys own their slots; the rest run an LRU that, for `pin`, only stages misses
            out.append(SlotPolicy(c - n_pin, LRU(c - n_pin), reserved=mine[:n_pin], keeps=policy == "pin+lru"))
        return out
    if policy == "belady":
        nxt_any, nxt_dec = next_uses(acc)
        return [SlotPolicy(c, Belady(c, nxt_any, nxt_dec)) for c in caps]
    make = {
        "lru": LRU,
        "fifo": FIFO,
        "s3fifo": S3FIFO,
        "lfu-decay": lambda c: LFUDecay(c, half_life),
    }.get(policy)
    if make is None:
        raise MoestreamError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    return [SlotPolicy(c, make(c)) for c in caps]
