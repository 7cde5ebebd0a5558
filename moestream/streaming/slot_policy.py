"""Which expert sits in which slot of the expert cache, and which one goes when another must come in: the
rules alone, with no reads, no memory and no tensors.

The live cache (expert_cache.py) drives a SlotPolicy with its reads; `moestream replay` (analysis/replay.py)
drives the same class over a trace's accesses, so what it counts is what the cache decides. Keys are any
hashable (the cache uses (layer, expert), the replay one integer per (layer, expert)); the order in which
unpinned keys are evicted is an EvictionOrder: LRU for the cache, any of the replay's policies for it.

The rules:
* A request (one fetch of a layer's experts) pins its hits until the caller unpins them; a key that a read
  started ahead of time is a miss all the same (its read is what serves it).
* A miss that is admitted takes a free slot while the cache is under its growth limit, else the eviction
  order's oldest unpinned key's slot, and is admitted and pinned at once, in request order, so that eviction
  depends only on the sequence of requests and never on which read finishes first.
* A miss that is not admitted (the prompt's, when prompt admission is off; a key seen fewer than min_hits
  times) borrows a scratch slot for its request and leaves the cache as it was.
* While a generation runs, each forward step may grow the cache by its allowance (per prompt micro-batch, or
  per decoded token) beyond what it held; outside one nothing limits it.
* Profile keys own slots that are never evicted; the elastic cache parks slots (gives their memory back) and
  unparks them later.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from moestream.errors import BudgetError

Key = Hashable


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_wait_s: float = 0.0  # time the model spent blocked waiting for reads
    evictions: int = 0
    pinned_hits: int = 0
    shrinks: int = 0  # elastic: times the cache gave slots back to the OS
    grows: int = 0
    slots_released: int = 0
    ahead_reads: int = 0  # experts the prompt read-ahead started reading
    ahead_unused: int = 0  # of those, experts the next layer did not ask for after all
    by_phase: dict[str, list[int]] = field(default_factory=lambda: {"prompt": [0, 0], "decode": [0, 0]})

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class EvictionOrder:
    """The keys a pool holds that may be evicted, and which goes first. The SlotPolicy owns the slots and
    the pins; an order only picks victims. `i` is the access's position in a replayed trace (oracles look
    ahead from it); the live cache passes 0."""

    def __init__(self, capacity: int):
        self.capacity = capacity

    def begin(self, g: int, step: int) -> None:  # a group (one request) starts
        pass

    def __contains__(self, key: Key) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def on_hit(self, key: Key, i: int) -> None:
        pass

    def on_miss(self, key: Key, i: int) -> None:  # every miss, admitted or not
        pass

    def wants(self, key: Key, i: int) -> bool:  # the order's own admission (Belady bypasses)
        return True

    def insert(self, key: Key, i: int) -> None:
        raise NotImplementedError

    def evict(self, pinned) -> Key | None:
        """Remove and return a key not in `pinned`; None if every key held is pinned."""
        raise NotImplementedError


class LRU(EvictionOrder):
    """Least recently used first: the live cache's order (and the replay's `lru`)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.od: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def __contains__(self, key: Key) -> bool:
        return key in self.od

    def __len__(self) -> int:
        return len(self.od)

    def __iter__(self) -> Iterator[Key]:
        return iter(self.od)

    def on_hit(self, key: Key, i: int) -> None:
        self.od.move_to_end(key)

    def insert(self, key: Key, i: int) -> None:
        self.od[key] = None

    def remove(self, key: Key) -> None:
        self.od.pop(key, None)

    def evict(self, pinned) -> Key | None:
        for key in self.od:  # the oldest key that is not pinned
            if key not in pinned:
                del self.od[key]
                return key
        return None


class Growth:
    """How far the cache may grow while a generation runs: each forward step by its allowance per unit (a
    prompt span of several micro-batches counts each) beyond what it held. The rule depends only on the
    sequence of steps, their units and the accesses, so a replay reproduces it."""

    def __init__(self, n_slots: int):
        self.prompt_slots = n_slots
        self.decode_slots = n_slots
        self.limit = 0
        self.generating = False

    def begin_step(self, units: int, prompt: bool, used: int, n_slots: int) -> None:
        grow = (self.prompt_slots if prompt else self.decode_slots) * max(1, units)
        self.limit = min(n_slots, max(self.limit, used) + grow)

    def allowed(self, n_slots: int) -> int:
        """Entries the eviction order may grow to now."""
        return self.limit if self.generating else n_slots


class AdmissionRule:
    """Which misses are admitted into the cache, and whether a request's hits refresh their recency.
    keeps=False: no miss ever is (they only borrow a slot for their request)."""

    def __init__(self, order: EvictionOrder, keeps: bool = True):
        self.order = order
        self.keeps = keeps
        self.prompt = True  # the prompt's misses are admitted (False: decode-only admission)
        self.min_hits = 0  # admit a key only once it was accessed this many times before
        self.seen: dict[Key, int] = {}

    def refreshes(self, prompt: bool, admit: bool = True) -> bool:
        """Whether a request's hits refresh their recency (a non-admitting prompt path leaves it alone)."""
        return admit and (not prompt or self.prompt)

    def admits(self, key: Key, prompt: bool, admit: bool = True, i: int = 0) -> bool:
        """Whether a miss is admitted into the cache (else it borrows a scratch slot)."""
        # accesses before this request (counted when a request ends: count)
        return (
            self.keeps
            and self.refreshes(prompt, admit)
            and self.seen.get(key, 0) >= self.min_hits
            and self.order.wants(key, i)
        )

    def count(self, keys: Iterable[Key]) -> None:
        """A request ended: its keys were accessed once more (what min_hits counts)."""
        if self.min_hits > 0:
            for key in keys:
                self.seen[key] = self.seen.get(key, 0) + 1


@dataclass
class Request:
    """One request's hits and misses, as positions in its keys: hits with their (pinned) slots, misses that
    need a slot, and misses whose read started ahead (their slots are placed and pinned already)."""

    hits: list[tuple[int, int]] = field(default_factory=list)
    missed: list[int] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)


class _Pinned:
    """`key in pinned`: whether the key's slot is pinned now (what an EvictionOrder must skip)."""

    def __init__(self, policy: SlotPolicy):
        self.policy = policy

    def __contains__(self, key: Key) -> bool:
        slot = self.policy.slot_of.get(key)
        return slot is not None and self.policy.pins[slot] > 0


class SlotPolicy:
    """n_slots slots: the last `scratch` of them serve misses that are not admitted; `reserved` keys (a
    replay's static pins) each own one more slot outside the pool, filled on their first miss. keeps=False:
    no miss is ever admitted (they only borrow scratch for their request)."""

    def __init__(
        self,
        n_slots: int,
        order: EvictionOrder | None = None,
        *,
        scratch: int = 0,
        reserved: Iterable[Key] = (),
        keeps: bool = True,
        stats: CacheStats | None = None,
    ):
        self.n_slots = n_slots
        self.order = order if order is not None else LRU(n_slots - scratch)
        self.reserved = frozenset(reserved)
        total = n_slots + len(self.reserved)
        self.key_of: list[Key | None] = [None] * total
        self.pins = [0] * total
        self.slot_of: dict[Key, int] = {}  # key -> slot, for the keys the order holds
        self.free: deque[int] = deque(range(n_slots - scratch))
        self.scratch: deque[int] = deque(range(n_slots - scratch, n_slots))
        self.scratch_set = frozenset(self.scratch)
        self._reserved_slots: deque[int] = deque(range(n_slots, total))
        self.profile: dict[Key, int] = {}  # loaded once, never evicted
        self.parked: list[int] = []  # slots the elastic cache gave back to the OS
        self.held: list[int] = []  # slots of resident keys the read-ahead pinned (release_held)
        self.admission = AdmissionRule(self.order, keeps)
        self.min_slots = 1  # elastic shrinking never goes below this many LRU slots
        self.growth = Growth(n_slots)
        self.stats = stats if stats is not None else CacheStats()
        self._pinned = _Pinned(self)

    # -- growth and admission --------------------------------------------------------------------------

    def begin_step(self, units: int, prompt: bool) -> None:
        """A forward step starts: the cache may grow by this step's allowance."""
        self.growth.begin_step(units, prompt, len(self.order), self.n_slots)

    def room(self) -> int:
        """Entries the cache may hold for one request now: its slots less scratch, within the limit."""
        return min(self.n_slots - len(self.scratch_set), self.growth.allowed(self.n_slots))

    # -- a request -------------------------------------------------------------------------------------

    def request(self, keys: Sequence[Key], refresh: bool, ahead=(), first: int = 0) -> Request:
        """Sort a request's keys (positions first.. in a trace) into hits, pinned now, and misses. `ahead`:
        keys whose reads started ahead (already placed)."""
        req = Request()
        for n, key in enumerate(keys):
            if key in ahead:
                if refresh:
                    self.order.on_hit(key, first + n)
                req.ahead.append(n)
                continue
            slot = self.profile.get(key)
            if slot is not None:
                self.stats.pinned_hits += 1
            else:
                slot = self.slot_of.get(key)
                if slot is not None and refresh:
                    self.order.on_hit(key, first + n)
            if slot is None:
                req.missed.append(n)
            else:
                self.pins[slot] += 1
                req.hits.append((n, slot))
        return req

    def take(self, admitted: bool, spare_free: bool = False) -> int | None:
        """A slot for a miss, or None if every one is pinned. Admitted: a free slot under the growth limit,
        else the eviction order's victim's; spare_free: where every key is pinned, a free slot beyond the
        limit rather than None (the live cache, which would otherwise wait for its reads). Not admitted: a
        scratch slot."""
        if not admitted:
            if not self.scratch_set:
                raise BudgetError(
                    "a miss that is not admitted needs a scratch slot; this cache has none (admission rules "
                    "need --ram-budget-mb for top-k more experts)"
                )
            return self.scratch.popleft() if self.scratch else None
        if self.free and len(self.order) < self.growth.allowed(self.n_slots):
            return self.free.popleft()
        slot = self._evict()
        if slot is None and spare_free and self.free:
            return self.free.popleft()
        return slot

    def place(self, key: Key, slot: int, admitted: bool = True, i: int = 0) -> None:
        """A miss goes into `slot`, pinned; admitted, it is in the cache from now on."""
        self.pins[slot] += 1
        if admitted:
            self.order.insert(key, i)
            self.slot_of[key] = slot
            self.key_of[slot] = key

    def place_profile(self, key: Key) -> int:
        """A profile key's slot, never evicted (pinned: unpin once it is filled). A reserved key fills its own
        slot outside the pool on its first miss; the live cache loads its profile into free slots at start."""
        slot = self._reserved_slots.popleft() if key in self.reserved else self.free.popleft()
        self.key_of[slot] = key
        self.profile[key] = slot
        self.pins[slot] += 1
        return slot

    def unpin(self, slot: int, release: bool = False) -> None:
        """A request is done with a slot; release: a slot that holds no key goes back to its free list."""
        self.pins[slot] -= 1
        if release and self.pins[slot] == 0 and self.key_of[slot] is None:
            (self.scratch if slot in self.scratch_set else self.free).append(slot)

    def forget(self, slot: int) -> None:
        """The key in `slot` leaves the cache (its read failed or was abandoned); the slot stays pinned."""
        key = self.key_of[slot]
        if key is None:
            return
        self.key_of[slot] = None
        if self.profile.pop(key, None) is None:
            self.order.remove(key)  # type: ignore[attr-defined]
            self.slot_of.pop(key, None)

    def _evict(self) -> int | None:
        key = self.order.evict(self._pinned)
        if key is None:
            return None
        slot = self.slot_of.pop(key)
        self.key_of[slot] = None
        self.stats.evictions += 1
        return slot

    # -- read-ahead, profile, elastic ------------------------------------------------------------------

    def hold(self, keys: Sequence[Key]) -> list[int]:
        """Before reading ahead: pin the resident ones of `keys` (release_held lets them go); returns the
        positions of those neither resident nor profile keys (what may be read ahead)."""
        fresh = []
        for n, key in enumerate(keys):
            if key in self.profile or key in self.reserved:
                continue
            slot = self.slot_of.get(key)
            if slot is None:
                fresh.append(n)
            else:
                self.pins[slot] += 1
                self.held.append(slot)
        return fresh

    def release_held(self) -> None:
        held, self.held = self.held, []
        for slot in held:
            self.unpin(slot)

    @property
    def capacity(self) -> int:
        """Slots usable now (profile + LRU); lower than n_slots after the elastic cache shrank."""
        return self.n_slots - len(self.parked)

    def shrink(self, n: int) -> list[int]:
        """Park up to n slots, free ones first, then the coldest keys'; returns them."""
        released: list[int] = []
        while len(released) < n and self.capacity - len(self.profile) > self.min_slots:
            slot = self.free.pop() if self.free else self._evict()
            if slot is None:
                break
            self.parked.append(slot)
            released.append(slot)
        if released:
            self.stats.shrinks += 1
            self.stats.slots_released += len(released)
        return released

    def grow(self, n: int) -> int:
        """Make up to n parked slots usable again."""
        n = min(n, len(self.parked))
        for _ in range(n):
            self.free.append(self.parked.pop())
        if n:
            self.stats.grows += 1
        return n
