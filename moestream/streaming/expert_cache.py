"""A fixed number of expert slots in one arena, filled from disk on a miss, evicted least recently used.

The model asks `fetch(layer, ids)` and receives (expert id, weights) pairs as they become available: the
experts already cached first, so it computes them while the missing ones are still being read. An expert
stays pinned from the moment it is requested until the model moves on from it, so nothing a token in flight
needs is ever evicted.

ExpertCache puts together its parts: the slot policy (slot_policy.py: which key is in which slot, what is
evicted, admitted, pinned, how far the cache grows; the replay runs the same one), the slot arena
(arena.py: the memory, the reads into it, the prefault), the read-ahead (ahead.py) and one Fetch per request
(fetch.py: start the misses, wait, deliver).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from moestream.compute.experts import ExpertWeights
from moestream.errors import BudgetError
from moestream.streaming.ahead import SEGMENTS, GuessSwitch, ReadAhead
from moestream.streaming.arena import MADV_POPULATE_WRITE, SlotArena
from moestream.streaming.expert_store import ExpertStore
from moestream.streaming.fetch import ORDERED_ROOM, Fetch, Group
from moestream.streaming.reader import ExpertReader
from moestream.streaming.slot_policy import LRU, CacheStats, SlotPolicy

__all__ = ["MADV_POPULATE_WRITE", "ORDERED_ROOM", "CacheStats", "ExpertCache", "TraceSink"]

# A trace sink receives one record per expert access: (layer, expert, rank = position in the request,
# source 'ram'|'disk', bytes read, read latency in seconds). Disk records arrive when reads complete.
TraceSink = Callable[[int, int, int, str, int, float], None]


class ExpertCache:
    def __init__(self, store: ExpertStore, reader: ExpertReader, n_slots: int, scratch_slots: int = 0):
        # a dense model's store has no expert layer: its cache is empty and is never asked for anything
        if n_slots < 1 and store.n_layers:
            raise BudgetError("the expert cache needs at least one slot; raise --ram-budget-mb")
        # Scratch slots serve misses that are not admitted (the prompt path when non-admitting, keys below
        # min-hits): used for one group and handed back, so such accesses never evict from the LRU.
        if scratch_slots >= n_slots and store.n_layers:
            raise BudgetError("the expert cache has no room besides its scratch slots; raise --ram-budget-mb")
        self.store = store
        self.reader = reader
        self.n_slots = n_slots
        self.slot_nbytes = store.slot_nbytes
        self.stats = CacheStats()
        self.policy = SlotPolicy(n_slots, scratch=scratch_slots, stats=self.stats)
        self.arena = SlotArena(store, reader, self.policy)
        self.ahead = ReadAhead(self.arena)
        self.phase = "decode"  # or "prompt": what the current forward step runs (begin_step)
        self._generations = 0  # generation() contexts open (nested: a scheduler's steps in a generation)
        self.trace: TraceSink | None = None
        self.read_ahead = True  # a prompt fetch may read the next layer ahead (read_ahead.py)
        self.guesses = GuessSwitch()  # whether a decode fetch starts the reads of the next layer's guesses

    def configure(
        self,
        *,
        min_slots: int = 1,
        prompt_slots: int | None = None,
        decode_slots: int | None = None,
        admit_prompt: bool = True,
        read_ahead: bool = True,
        lookahead: str = "off",
        min_hits: int = 0,
        trace: TraceSink | None = None,
    ) -> None:
        """The policy, set once by the engine before the first access.

        min_slots: elastic shrinking keeps this many LRU slots. prompt_slots, decode_slots: while a
        generation runs, how far each prompt micro-batch or decoded token may grow the cache (committing
        fresh memory under a running model slows it; read_ahead.prompt_slots); unlimited by default.
        admit_prompt=False: the prompt path neither admits nor refreshes, so its cold reads do not push out
        what the decode reuses. min_hits > 0 admits a key only once it has missed that many times before.
        lookahead: the router lookahead's mode, 'on', 'off' or 'auto' (ahead.GuessSwitch).
        """
        policy = self.policy
        policy.min_slots = min_slots
        policy.growth.prompt_slots = self.n_slots if prompt_slots is None else prompt_slots
        policy.growth.decode_slots = self.n_slots if decode_slots is None else decode_slots
        policy.admission.prompt, policy.admission.min_hits = admit_prompt, min_hits
        self.read_ahead = read_ahead
        self.guesses = GuessSwitch(lookahead)
        self.trace = trace

    @contextmanager
    def untraced(self) -> Iterator[None]:
        """Accesses that are not the model's (a benchmark's preload) stay out of the trace."""
        trace, self.trace = self.trace, None
        try:
            yield
        finally:
            self.trace = trace

    @contextmanager
    def generation(self) -> Iterator[None]:
        """While the model generates: steps grow the LRU by their allowance only, and the prefault waits.
        Nested (a scheduler's step inside a whole generation), only the outermost one counts: the prefault
        must not run between the steps of one generation."""
        self._generations += 1
        if self._generations == 1:
            self.policy.growth.generating = True
            self.arena.gate.set_idle(False)
        try:
            yield
        finally:
            self._generations -= 1
            if not self._generations:
                self.policy.growth.generating = False
                self.phase = "decode"
                self.arena.gate.set_idle(True)

    def begin_step(self, units: int = 1, phase: str | None = None) -> None:
        """A forward step of `units` micro-batches starts, in `phase` ('prompt' or 'decode'; the current
        phase if None): the LRU may grow by this step's allowance (SlotPolicy.begin_step)."""
        if phase is not None:
            self.phase = phase
        self.ahead.known.clear()  # what an abandoned step knew
        with self.arena.lock:
            self.policy.begin_step(units, self.phase == "prompt")

    # -- the model's view ------------------------------------------------------------------------------

    def fetch(self, layer: int, ids: list[int], admit: bool = True) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield (expert id, weights) for every id, cached ones first (see fetch_groups)."""
        for group in self.fetch_groups(layer, ids, admit):
            yield from group

    def fetch_groups(self, layer: int, ids: list[int], admit: bool = True, ordered: bool = False) -> Iterator[Group]:
        """Yield every id's (expert id, weights) in groups: first all the cached ones, then the misses as their
        reads complete (those that complete together in one group). A group stays pinned until the next yield.
        admit=False: what is read is used once and not kept; ordered: in the order of ids (Fetch)."""
        return Fetch(self, layer, ids, admit, ordered).groups()

    @property
    def lookahead(self) -> bool:
        """Whether the router lookahead guesses now (the MoE layers ask before they compute a guess)."""
        return self.guesses.active

    def guess(self, layer: int, ids: list[int]) -> None:
        """The experts `layer` will probably ask for (the router lookahead: the previous layer's input through
        this layer's router). The fetch of the layer before starts their reads once its own are under way
        (Fetch), where the lookahead is on and the step decodes; the layer's own fetch then takes them."""
        self.ahead.guessed = (layer, ids) if self.lookahead and self.phase == "decode" else None

    def prefetch(self, layer: int, ids: list[int]) -> int:
        """Experts of `layer` known ahead of the compute (DeepSeek-V4's hash-routed layers, from the token
        ids): a decode step starts their reads a layer ahead, as the lookahead does its guesses (the first
        such layer's now, each next one's when the fetch of the layer before starts), so that they overlap
        the compute, where the reader has buffers to spare for them (the lookahead's); a prompt, or a traced
        run (whose replay reads the accesses in order), reads them now and waits. Skipped where they would
        take more than a quarter of the cache (they would push out what the step needs first). Returns how
        many were asked."""
        if not ids or 4 * len(ids) > self.capacity:
            return 0
        if self.phase == "decode" and self.trace is None and self.reader.ahead_buffers(runs=False) >= SEGMENTS:
            if self.ahead.layer < 0 and not self.ahead.known:
                self.ahead.start_ids(layer, ids)
            else:
                self.ahead.known[layer] = ids
            return len(ids)
        for _group in self.fetch_groups(layer, ids):
            pass
        return len(ids)

    # -- the profile part ------------------------------------------------------------------------------

    def pin(self, keys: list[tuple[int, int]], progress: bool = False) -> int:
        """Load these experts into slots that are never evicted (the profile part of the RAM tier).

        Call before decoding starts. Keeps at least `min_slots` slots for the LRU part; returns how many
        experts were pinned.
        """
        from tqdm import tqdm

        policy, arena = self.policy, self.arena
        room = max(0, len(policy.free) - policy.min_slots)
        keys = [k for k in dict.fromkeys(keys) if k not in policy.profile][:room]
        bar = tqdm(total=len(keys), unit="expert", desc="pinning profile", disable=not progress)
        batch = max(1, self.reader.threads * 2)
        for i in range(0, len(keys), batch):
            with arena.lock:
                inflight = [arena.fill(*key, policy.place_profile(key)) for key in keys[i : i + batch]]
            for j, p in enumerate(inflight):
                try:
                    experts = arena.finish(p)
                except BaseException:
                    for q in inflight[j:]:
                        arena.abandon(q, {})
                    bar.close()
                    raise
                with arena.lock:
                    arena.experts[p.slot] = experts
                    policy.unpin(p.slot)
                self.stats.bytes_read += self.store.expert_file_nbytes[p.layer]
                bar.update(1)
        bar.close()
        return len(keys)

    @property
    def pinned_slots(self) -> int:
        return len(self.policy.profile)

    # -- elastic capacity and memory -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots currently usable (pinned + LRU); lower than n_slots after the elastic cache shrank."""
        return self.policy.capacity

    def shrink(self, n: int) -> int:
        """Give up to n LRU slots back to the OS at once (coldest first); returns how many were released."""
        with self.arena.lock:
            released = self.policy.shrink(n)
            for slot in released:
                self.arena.release_memory(slot)
        return len(released)

    def grow(self, n: int) -> int:
        """Make up to n parked slots usable again (their memory is committed when they next fill)."""
        with self.arena.lock:
            return self.policy.grow(n)

    def prefault(self, background: bool = True):
        """Commit the arena's pages ahead of use, off the model's thread (SlotArena.prefault)."""
        return self.arena.prefault(background)

    # -- inspection ------------------------------------------------------------------------------------

    def cached_keys(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs held, least recently used first."""
        with self.arena.lock:
            return list(self.policy.order)  # type: ignore[call-overload]

    @property
    def used_slots(self) -> int:
        return len(self.policy.order)

    def close(self) -> None:
        self.ahead.drop()
        self.arena.close()
        with self.arena.lock:  # nothing is held any more
            self.policy.order, self.policy.slot_of, self.policy.profile = LRU(0), {}, {}
