"""A fixed number of expert slots in one arena, filled from disk on a miss, evicted least recently used.

The model asks `fetch(layer, ids)` and receives (expert id, weights) pairs as they become available: the
experts already cached first, so it computes them while the missing ones are still being read. An expert
stays pinned from the moment it is requested until the model moves on from it, so nothing a token in flight
needs is ever evicted.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from moestream.compute import linear
from moestream.errors import BudgetError
from moestream.streaming.expert_store import ExpertStore
from moestream.streaming.libc import libc
from moestream.streaming.pending import Expert, PendingExpert, pack_lanes
from moestream.streaming.read_ahead import ahead_choice, ahead_reads, consecutive_runs, reads_ahead
from moestream.streaming.reader import ExpertReader, Lease

MADV_POPULATE_WRITE = 23  # Linux 5.14+
# an ordered fetch keeps its order where the cache may hold this many times its request (fetch_groups)
ORDERED_ROOM = 2


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


# A trace sink receives one record per expert access: (layer, expert, rank = position in the request,
# source 'ram'|'disk', bytes read, read latency in seconds). Disk records arrive when reads complete.
TraceSink = Callable[[int, int, int, str, int, float], None]


class ExpertCache:
    def __init__(self, store: ExpertStore, reader: ExpertReader, n_slots: int, scratch_slots: int = 0):
        if n_slots < 1:
            raise BudgetError("the expert cache needs at least one slot; raise --ram-budget-mb")
        self.store = store
        self.reader = reader
        self.n_slots = n_slots
        self.slot_nbytes = store.slot_nbytes
        # Anonymous mmap: pages are only committed when a slot is first filled, and can be handed back to
        # the OS (madvise) when the cache shrinks.
        # Private, not Python's default shared mapping: MADV_DONTNEED on shared anonymous memory leaves the
        # pages in shmem, so a shrinking cache gave nothing back (a second process was OOM-killed).
        self._arena = mmap.mmap(-1, n_slots * self.slot_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._arena_t = torch.frombuffer(self._arena, dtype=torch.uint8)
        self._experts: list[Expert | None] = [None] * n_slots
        self._key_of: list[tuple[int, int] | None] = [None] * n_slots
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> slot, oldest first
        self._pins = [0] * n_slots
        # Scratch slots serve misses that are not admitted (the prompt path when non-admitting, keys below
        # min-hits): used for one group and handed back, so such accesses never evict from the LRU.
        if scratch_slots >= n_slots:
            raise BudgetError("the expert cache has no room besides its scratch slots; raise --ram-budget-mb")
        self._free: deque[int] = deque(range(n_slots - scratch_slots))
        self._scratch: deque[int] = deque(range(n_slots - scratch_slots, n_slots))
        self._scratch_set = frozenset(self._scratch)
        self._pinned: dict[tuple[int, int], int] = {}  # profile part: loaded at start, never evicted
        self._parked: list[int] = []  # slots the elastic cache gave back to the OS
        self._lock = threading.RLock()
        self._closed = False
        self._prefault_thread: threading.Thread | None = None
        self.stats = CacheStats()
        # While a generation runs, each forward step may grow the LRU by at most prompt_slots (per prompt
        # micro-batch of the step) or decode_slots (a decoded token) entries, and the prefault waits: committing fresh
        # memory under a running model slowed it most in a VM (read_ahead.prompt_slots has the figures).
        self.prompt_slots = n_slots
        self.decode_slots = n_slots
        self._limit = 0
        self._generating = False
        self._idle = threading.Event()
        self._idle.set()
        self.phase = "decode"
        self.trace: TraceSink | None = None
        # Admission. The prompt path reads every cold expert once; admitting those would push out what the
        # decode reuses (Strata), so it can be made to neither admit nor refresh. min_hits > 0 admits a key
        # only once it has missed that many times before (the SDQ seed measured it as a loss; kept as option).
        self.admit_prompt = True
        self.min_hits = 0
        self._access_counts: dict[tuple[int, int], int] = {}
        self.min_slots = 1  # elastic shrinking never goes below this many LRU slots
        self.read_ahead = True
        # The next layer's experts being read ahead (expert -> pending; slot pinned and already admitted),
        # and the slots of its cached experts, pinned so that the read-ahead cannot evict them.
        self._ahead: dict[int, PendingExpert] = {}
        self._ahead_layer = -1
        self._reserved: list[int] = []

    def configure(
        self,
        *,
        min_slots: int,
        prompt_slots: int,
        decode_slots: int,
        admit_prompt: bool = True,
        read_ahead: bool = True,
        min_hits: int = 0,
        trace: TraceSink | None = None,
    ) -> None:
        """The policy, set once by the engine before the first access (see the attributes in __init__)."""
        self.min_slots = min_slots
        self.prompt_slots, self.decode_slots = prompt_slots, decode_slots
        self.admit_prompt, self.read_ahead, self.min_hits = admit_prompt, read_ahead, min_hits
        self.trace = trace

    @contextmanager
    def untraced(self) -> Iterator[None]:
        """Accesses that are not the model's (a benchmark's preload) stay out of the trace."""
        trace, self.trace = self.trace, None
        try:
            yield
        finally:
            self.trace = trace

    # -- growth while generating ------------------------------------------------------------------------

    @contextmanager
    def generation(self) -> Iterator[None]:
        """While the model generates: steps grow the LRU by their allowance only, and the prefault waits."""
        self._generating = True
        self._idle.clear()
        try:
            yield
        finally:
            self._generating = False
            self.phase = "decode"
            self._idle.set()

    def begin_step(self, units: int = 1) -> None:
        """A forward step starts (the engine calls it): the LRU may grow by this step's allowance, per unit (a
        prompt span of several micro-batches counts each). The rule depends only on the sequence of steps,
        their units and the accesses, so the replay reproduces it."""
        grow = (self.prompt_slots if self.phase == "prompt" else self.decode_slots) * max(1, units)
        with self._lock:
            self._limit = min(self.n_slots, max(self._limit, len(self._lru)) + grow)

    # -- slot bookkeeping ------------------------------------------------------------------------------

    def _lru_limit(self) -> int:
        """LRU entries this access may grow the cache to."""
        return self._limit if self._generating else self.n_slots

    def _take_slot(self) -> int | None:
        if self._free and len(self._lru) < self._lru_limit():
            return self._free.popleft()
        slot = self._evict_lru()
        if slot is None and self._free:  # every entry pinned: a free slot rather than a wait
            return self._free.popleft()
        return slot

    def _evict_lru(self) -> int | None:
        for key, slot in self._lru.items():
            if self._pins[slot] == 0:
                del self._lru[key]
                self._key_of[slot] = None
                self._experts[slot] = None
                self.stats.evictions += 1
                return slot
        return None

    def _admits(self, key: tuple[int, int], admit: bool) -> bool:
        if not admit or (self.phase == "prompt" and not self.admit_prompt):
            return False
        # accesses before this group (counted when a fetch ends), as the replay counts them
        return self._access_counts.get(key, 0) >= self.min_hits

    def _fill(self, layer: int, expert: int, slot: int) -> PendingExpert:
        """Start the three segment reads of an expert into pooled buffers; the caller packs them (finish)."""
        p = self._pending(layer, expert, slot)
        return p.started([self.reader.read(seg.offset, seg.nbytes) for seg in p.segs])

    def _fill_pairs(self, layer: int, pairs: list[tuple[int, int]]) -> list[PendingExpert]:
        """Start reading (expert, slot) pairs: in a prompt consecutive experts together (_fill_run), in decode
        one by one (its few misses are rarely adjacent, and the run buffers are the prompt's)."""
        if self.phase != "prompt":
            return [self._fill(layer, e, slot) for e, slot in pairs]
        runs = consecutive_runs(pairs, self.reader.run_len, key=lambda pair: pair[0])
        return [p for run in runs for p in self._fill_run(layer, run)]

    def _fill_run(self, layer: int, run: list[tuple[int, int]]) -> list[PendingExpert]:
        """Start reading (expert, slot) pairs of consecutive experts: each of the three matrices of the whole
        run is one read (they are adjacent in the file), handed over expert by expert."""
        first = self.store.segments(layer, run[0][0])
        runs = [self.reader.read_run(seg.offset, seg.nbytes, len(run)) for seg in first]
        return [self._pending(layer, e, slot).started([r[j] for r in runs]) for j, (e, slot) in enumerate(run)]

    def _pending(self, layer: int, expert: int, slot: int) -> PendingExpert:
        """An expert about to be read into `slot`: where each of its matrices goes."""
        layout = self.store.layouts[layer]
        base = slot * self.slot_nbytes
        arena = self._arena_t
        outs = [arena[base + off : base + off + size] for off, size in zip(layout.offsets, layout.packed, strict=True)]
        segs = self.store.segments(layer, expert)
        fused = None
        if layout.fused_gate_up and layout.gate_kind == "lane":
            # lane form: gate rows then up rows are adjacent in the slot, one [2F, row bytes] matrix
            fused = self._arena_t[base : base + 2 * layout.packed[0]].view(2 * segs[0].n, -1)
        elif layout.fused_gate_up:
            # Same bytes as two separate int4 forms: [gate rows | up rows] then their scales side by side.
            n, k = segs[0].n, segs[0].k
            w = self._arena_t[base : base + n * k].view(2 * n, k // 2)
            sz_bytes = (k // linear.GROUP) * 2 * n * 2 * 2
            sz = (
                self._arena_t[base + n * k : base + n * k + sz_bytes]
                .view(torch.bfloat16)
                .view(k // linear.GROUP, 2 * n, 2)
            )
            fused = (w, sz)
        lane = None
        if layout.all_lane:
            lane = [base + off + arena.data_ptr() for off in layout.offsets]
            down = segs[2]
            outs[2] = outs[2].view(down.n, layout.packed[2] // down.n)
        # The reader threads only read; the model's thread packs each segment as it lands, in the prompt too:
        # with the lane form's packing at memory speed that beat packing in the reader threads (prefill
        # 8.0-8.3 vs 7.0-7.6 tok/s, Qwen3-30B shape, 7168 MB), which then competed with the lane pool.
        return PendingExpert(layer, expert, slot, segs, outs, [], self.store.exact, fused, lane)

    # -- the model's view ------------------------------------------------------------------------------

    def fetch(self, layer: int, ids: list[int], admit: bool = True) -> Iterator[tuple[int, Expert]]:
        """Yield (expert id, weights) for every id, cached ones first (see fetch_groups)."""
        for group in self.fetch_groups(layer, ids, admit):
            yield from group

    def fetch_groups(
        self, layer: int, ids: list[int], admit: bool = True, ordered: bool = False
    ) -> Iterator[list[tuple[int, Expert]]]:
        """Yield every id's (expert id, weights) in groups: first all the cached ones, then the misses as their
        reads complete (those that complete together in one group). A group stays pinned until the next yield,
        so the model can compute a whole group in one kernel call.

        With admit=False, experts read from disk are used once and their slots go straight back to the free
        list, so the access does not push anything out of the cache (the prompt path, when configured so).

        ordered=True yields in the order of `ids` instead (a long prompt span: the model then sums each
        expert's rows into the output as it comes, instead of holding every (token, expert) result until the
        last one), where the cache may grow to twice the request (ORDERED_ROOM): what waits for an earlier
        miss then stays pinned without changing what the cache evicts, so its decisions (and the replay of
        its trace) are those of the unordered fetch. A smaller cache, or one that does not admit what it
        reads, yields as the reads complete. Should the slots still run out, a group comes early, out of order.
        """
        if self._ahead_layer >= 0 and self._ahead_layer != layer:
            self._drop_ahead()  # read ahead for a layer this call is not: an abandoned forward pass
        phase = self.stats.by_phase[self.phase]
        refresh = admit and (self.phase != "prompt" or self.admit_prompt)
        room = min(self.n_slots - len(self._scratch_set), self._lru_limit())
        ordered = ordered and refresh and self.min_hits == 0 and room >= ORDERED_ROOM * len(ids)
        hits: list[tuple[int, int]] = []
        pending: deque[int] = deque()
        taken: list[PendingExpert] = []  # misses whose reads the previous layer's fetch started (read-ahead)
        with self._lock:
            for e in ids:
                key = (layer, e)
                slot = self._pinned.get(key)
                if slot is not None:
                    self.stats.pinned_hits += 1
                elif e in self._ahead:  # admitted and pinned when its read started; a miss all the same
                    if refresh:
                        self._lru.move_to_end(key)
                    taken.append(self._ahead.pop(e))
                    continue
                else:
                    slot = self._lru.get(key)
                    if slot is not None and refresh:
                        self._lru.move_to_end(key)
                if slot is not None:
                    self._pins[slot] += 1
                    hits.append((e, slot))
                else:
                    pending.append(e)
            self.stats.hits += len(hits)
            self.stats.misses += len(pending) + len(taken)
            phase[0] += len(hits)
            phase[1] += len(pending) + len(taken)
            unused = list(self._ahead.values())  # read ahead but not asked for: finished here, not yielded
            self.stats.ahead_unused += len(unused)
            reserved = self._reserved
            self._ahead, self._ahead_layer, self._reserved = {}, -1, []
        for slot in reserved:  # this call's own pins are in place
            self._unpin(slot)
        inflight: dict[Future, PendingExpert] = {}  # segment read -> the expert it belongs to
        completed: queue.SimpleQueue[Future] = queue.SimpleQueue()  # reads as they finish
        for p in (*taken, *unused):
            for fut in p.futures:
                inflight[fut] = p
                fut.add_done_callback(completed.put)
        unused_ids = {id(p) for p in unused}
        hitq = deque(hits)
        # ordered: what is in hand but waits for an earlier id (request position -> expert id, slot, read)
        held: dict[int, tuple[int, int, bool]] = {}
        position = {e: i for i, e in enumerate(ids)} if ordered else {}
        next_pos = 0
        early: set[int] = set()  # positions yielded ahead of their turn

        def in_order(all_held: bool = False) -> list[tuple[int, int, bool]]:
            """The held experts to yield now: those from next_pos on without a gap (every one if all_held)."""
            nonlocal next_pos
            if all_held:
                early.update(held)
                return [held.pop(i) for i in sorted(held)]
            run = []
            while next_pos in held or next_pos in early:
                if next_pos in held:
                    run.append(held.pop(next_pos))
                next_pos += 1
            return run

        def complete(p: PendingExpert, experts: Expert | None, ready: list[PendingExpert]) -> None:
            """A read expert's bookkeeping once its last segment is packed; ready collects those to yield."""
            if experts is None:
                return  # other segments of this expert are still being read
            nbytes = self.store.expert_file_nbytes[layer]
            self.stats.bytes_read += nbytes
            with self._lock:
                self._experts[p.slot] = experts
            if id(p) in unused_ids:  # read ahead, not asked for: cached, not yielded
                self._unpin(p.slot)
                return
            ready.append(p)
            if self.trace is not None:
                self.trace(layer, p.expert, ids.index(p.expert), "disk", nbytes, p.latency())

        def launch() -> None:
            started: list[tuple[int, int]] = []  # (expert, slot)
            with self._lock:
                while pending:
                    admitted = self._admits((layer, pending[0]), admit)
                    if admitted:
                        slot = self._take_slot()
                    else:
                        if not self._scratch_set:
                            raise BudgetError(
                                "a miss that is not admitted needs a scratch slot; this cache has "
                                "none (admission rules need --ram-budget-mb for top-k more experts)"
                            )
                        slot = self._scratch.popleft() if self._scratch else None
                    if slot is None:
                        break
                    e = pending.popleft()
                    self._pins[slot] += 1
                    if admitted:
                        # Admitted in request order, at once: eviction order then depends only on the
                        # sequence of requests, never on which read finished first (replay reproduces it).
                        self._key_of[slot] = (layer, e)
                        self._lru[(layer, e)] = slot
                    started.append((e, slot))
                for p in self._fill_pairs(layer, started):
                    for fut in p.futures:
                        inflight[fut] = p
                        fut.add_done_callback(completed.put)
            if pending and not inflight and not hitq and not held:
                raise BudgetError(
                    f"all {self.n_slots} expert slots are pinned; raise --ram-budget-mb so at least "
                    f"{len(ids)} experts fit"
                )

        try:
            launch()
            if (
                self.read_ahead
                and refresh
                and self.phase == "prompt"
                and self.min_hits == 0
                and not pending
                and layer + 1 < self.store.n_layers
                and reads_ahead(
                    len(ids), self.store.n_experts, min(self.n_slots - len(self._scratch_set), self._lru_limit())
                )
            ):
                self._start_ahead(layer + 1)
            if hitq and self.trace is not None:
                for e, _slot in hitq:
                    self.trace(layer, e, ids.index(e), "ram", 0, 0.0)
            if ordered:
                while hitq:
                    e, slot = hitq.popleft()
                    held[position[e]] = (e, slot, False)
                yield from self._yield_held(in_order())
            if hitq:
                group = [(e, self._experts[slot]) for e, slot in hitq]
                try:
                    yield group  # type: ignore[misc]
                finally:
                    while hitq:
                        self._unpin(hitq.popleft()[1])
            launch()
            while inflight or (ordered and (held or pending)):
                if ordered and not inflight:
                    # the next id waits for a slot that what is held pins: yield it early, out of order
                    yield from self._yield_held(in_order(all_held=True))
                    launch()
                    continue
                # A completion queue, not concurrent.futures.wait: that re-registers a waiter on every future
                # in flight per call, O(n^2) over a prompt layer's ~250 segment reads (3 s of a 15 s prefill).
                t_wait = time.perf_counter()
                try:
                    done = [completed.get(timeout=self.reader.wait_s)]
                except queue.Empty:
                    raise self.reader.error(
                        f"no expert read finished within {self.reader.wait_s:g} s; the disk is not responding"
                    ) from None
                self.stats.read_wait_s += time.perf_counter() - t_wait
                while not completed.empty():
                    done.append(completed.get_nowait())
                done = [f for f in done if f in inflight]  # reads of an expert abandoned meanwhile
                ready: list[PendingExpert] = []
                try:
                    lanes: list[tuple[PendingExpert, int, Lease]] = []  # packed together, below
                    packed = False
                    try:
                        for fut in done:
                            p = inflight.pop(fut)
                            try:
                                if p.lane is not None:
                                    lanes.append(p.take(fut))
                                    continue
                                experts = p.segment_done(fut)
                            except BaseException:
                                self._abandon(p, inflight)
                                raise
                            complete(p, experts, ready)
                        packed = True
                        if lanes:
                            pack_lanes(lanes)  # gives the leases back, whatever happens
                    except BaseException:
                        if not packed:
                            for _, _, lease in lanes:
                                lease.release()
                        for p in {id(p): p for p, _, _ in lanes}.values():
                            self._abandon(p, inflight)
                        raise
                    for p, _, _ in lanes:
                        complete(p, p.lane_done(), ready)
                    if ordered:
                        for p in ready:
                            held[position[p.expert]] = (p.expert, p.slot, True)
                        ready = []
                    elif ready:
                        yield [(p.expert, self._experts[p.slot]) for p in ready]  # type: ignore[misc]
                finally:
                    for p in ready:
                        self._unpin(p.slot, release=True)  # frees it only if it was not admitted
                if ordered:
                    yield from self._yield_held(in_order())
                launch()
        finally:
            # On an exception or an abandoned generator, drain reads that still hold buffers and slots.
            for p in {id(p): p for p in inflight.values()}.values():
                self._abandon(p, inflight)
            for _e, slot in hitq:
                self._unpin(slot)
            for _e, slot, read in held.values():
                self._unpin(slot, release=read)
            if self.min_hits > 0:
                for e in ids:
                    self._access_counts[(layer, e)] = self._access_counts.get((layer, e), 0) + 1

    def _yield_held(self, run: list[tuple[int, int, bool]]) -> Iterator[list[tuple[int, Expert]]]:
        """Yield `run` (expert id, slot, whether it was read) as one group, then unpin it (a read's slot freed
        if it was not admitted), whatever the consumer does."""
        if not run:
            return
        try:
            yield [(e, self._experts[slot]) for e, slot, _read in run]  # type: ignore[misc]
        finally:
            for _e, slot, read in run:
                self._unpin(slot, release=read)

    def _start_ahead(self, layer: int) -> None:
        """Start reading the first experts of `layer` that are not cached (ahead_experts of them, in expert
        order), each admitted at once; the layer's cached experts are pinned first so that the read-ahead
        evicts none of them. Their reads wait in the reader's buffers until the layer's fetch packs them."""
        need = ahead_reads(self.store.n_experts, self.reader.run_len)
        if self.reader.ahead_buffers() < need:
            raise ValueError(
                f"the read-ahead holds up to {need} reads but the reader spares {self.reader.ahead_buffers()} "
                "buffers for it; build the reader with planning.read_buffers"
            )
        with self._lock:
            fresh = []
            for e in range(self.store.n_experts):
                key = (layer, e)
                if key in self._pinned:
                    continue
                slot = self._lru.get(key)
                if slot is None:
                    fresh.append(e)
                else:
                    self._pins[slot] += 1
                    self._reserved.append(slot)
            self._ahead_layer = layer
            # What it reads waits in the reader's buffers until the layer's fetch (ahead_choice keeps it within
            # the buffers planned for it).
            chosen: list[tuple[int, int]] = []
            for e in ahead_choice(fresh, self.store.n_experts, self.reader.run_len):
                slot = self._take_slot()
                if slot is None:
                    break
                self._pins[slot] += 1
                self._key_of[slot] = (layer, e)
                self._lru[(layer, e)] = slot
                chosen.append((e, slot))
            for p in self._fill_pairs(layer, chosen):
                self._ahead[p.expert] = p
            self.stats.ahead_reads += len(chosen)

    def _drop_ahead(self) -> None:
        """Drop what was read ahead for a layer that will not be fetched next (the forward pass that started it
        was abandoned): its reads are waited for and forgotten, their errors with them, and its pins go."""
        with self._lock:
            ahead, reserved = list(self._ahead.values()), self._reserved
            self._ahead, self._ahead_layer, self._reserved = {}, -1, []
        for slot in reserved:
            self._unpin(slot)
        for p in ahead:
            self._abandon(p, {})

    def _abandon(self, p: PendingExpert, inflight: dict[Future, PendingExpert]) -> None:
        """Drop an expert whose reads failed or are no longer wanted: release its buffers and its slot (once:
        an error path may reach the same expert twice, by two of its segments)."""
        if p.abandoned:
            return
        p.abandoned = True
        for fut in p.futures:
            inflight.pop(fut, None)
        p.drain()
        self._forget(p.slot)  # never yielded: its contents were not checked, so do not keep them
        self._unpin(p.slot, release=True)

    def _forget(self, slot: int) -> None:
        with self._lock:
            key = self._key_of[slot]
            if key is not None:
                self._lru.pop(key, None)
                self._key_of[slot] = None
            self._experts[slot] = None

    def _unpin(self, slot: int, release: bool = False) -> None:
        with self._lock:
            self._pins[slot] -= 1
            if release and self._pins[slot] == 0 and self._key_of[slot] is None:
                self._experts[slot] = None
                (self._scratch if slot in self._scratch_set else self._free).append(slot)

    # -- the profile part ------------------------------------------------------------------------------

    def pin(self, keys: list[tuple[int, int]], progress: bool = False) -> int:
        """Load these experts into slots that are never evicted (the profile part of the RAM tier).

        Call before decoding starts. Keeps at least `min_slots` slots for the LRU part; returns how many
        experts were pinned.
        """
        from tqdm import tqdm

        room = max(0, len(self._free) - self.min_slots)
        keys = [k for k in dict.fromkeys(keys) if k not in self._pinned][:room]
        bar = tqdm(total=len(keys), unit="expert", desc="pinning profile", disable=not progress)
        batch = max(1, self.reader.threads * 2)
        for i in range(0, len(keys), batch):
            inflight = []
            with self._lock:
                for layer, e in keys[i : i + batch]:
                    slot = self._free.popleft()
                    self._pins[slot] += 1
                    inflight.append(((layer, e), slot, self._fill(layer, e, slot)))
            for j, (key, slot, p) in enumerate(inflight):
                try:
                    experts = self._finish(p)
                except BaseException:
                    for _, _, q in inflight[j:]:
                        self._abandon(q, {})
                    bar.close()
                    raise
                with self._lock:
                    self._experts[slot] = experts
                    self._key_of[slot] = key
                    self._pinned[key] = slot
                    self._pins[slot] -= 1
                self.stats.bytes_read += self.store.expert_file_nbytes[key[0]]
                bar.update(1)
        bar.close()
        return len(keys)

    def _finish(self, p: PendingExpert) -> Expert:
        """Wait for an expert's reads (within the reader's deadline) and pack them."""
        if wait(p.futures, timeout=self.reader.wait_s).not_done:
            raise self.reader.error(f"an expert's reads did not finish within {self.reader.wait_s:g} s")
        return p.finish()

    @property
    def pinned_slots(self) -> int:
        return len(self._pinned)

    # -- elastic capacity ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots currently usable (pinned + LRU); lower than n_slots after the elastic cache shrank."""
        return self.n_slots - len(self._parked)

    def shrink(self, n: int) -> int:
        """Give up to n LRU slots back to the OS at once (coldest first); returns how many were released."""
        released = 0
        with self._lock:
            while released < n and self.capacity - len(self._pinned) > self.min_slots:
                slot = self._free.pop() if self._free else self._evict_lru()
                if slot is None:
                    break
                self._release_memory(slot)
                self._parked.append(slot)
                released += 1
            if released:
                self.stats.shrinks += 1
                self.stats.slots_released += released
        return released

    def grow(self, n: int) -> int:
        """Make up to n parked slots usable again (their memory is committed when they next fill)."""
        with self._lock:
            n = min(n, len(self._parked))
            for _ in range(n):
                self._free.append(self._parked.pop())
            if n:
                self.stats.grows += 1
        return n

    def prefault(self, background: bool = True) -> threading.Thread | None:
        """Commit the arena's pages ahead of use (MADV_POPULATE_WRITE, in chunks, off the model's thread).

        A slot's first fill otherwise takes its page faults inside the pack: 0.8 ms instead of 0.18 ms per
        768x2048 matrix measured here, most of a cold cache's miss cost. Only worth it when the user gave the
        budget: the memory is promised to the cache anyway. In this VM it commits ~0.45 GB/s, so a 7 GB
        cache is ready ~16 s after start; fills before that fault as usual. It waits while the model
        generates: committing fresh memory slows the whole VM (begin_step: how the cache grows meanwhile).
        """
        lib = libc()
        base = self._arena_t.data_ptr()
        slots_per_call = max(1, (32 << 20) // self.slot_nbytes)

        def run() -> None:
            for first in range(0, self.n_slots, slots_per_call):
                self._idle.wait()  # not while the model runs: its steps grow the cache a little each
                # Stop as soon as the elastic cache has had to give memory back: prefaulting would take it again.
                if self._closed or self.stats.shrinks:
                    return
                with self._lock:
                    todo = [s for s in range(first, min(self.n_slots, first + slots_per_call)) if s not in self._parked]
                for slot in todo:
                    if self.stats.shrinks:
                        return
                    addr = ctypes.c_void_p(base + slot * self.slot_nbytes)
                    if lib.madvise(addr, ctypes.c_size_t(self.slot_nbytes), MADV_POPULATE_WRITE) != 0:
                        return  # kernel before 5.14: pages fault in on first use, as without prefaulting

        if not background:
            run()
            return None
        t = threading.Thread(target=run, name="moestream-prefault", daemon=True)
        t.start()
        self._prefault_thread = t
        return t

    def wait_prefault(self) -> None:
        """Block until a background prefault has committed the arena (benchmarks that time a committed cache)."""
        if self._prefault_thread is not None:
            self._prefault_thread.join()

    def _release_memory(self, slot: int) -> None:
        start = slot * self.slot_nbytes
        self._arena.madvise(mmap.MADV_DONTNEED, start, self.slot_nbytes)

    # -- inspection ------------------------------------------------------------------------------------

    def cached_keys(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs held, least recently used first."""
        with self._lock:
            return list(self._lru)

    @property
    def used_slots(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        self._closed = True
        self._idle.set()  # a waiting prefault sees _closed and ends
        self._drop_ahead()
        if self._prefault_thread is not None:
            self._prefault_thread.join()  # it stops at the next chunk
        self._experts = [None] * self.n_slots
        self._lru.clear()
        self._pinned.clear()
        # No explicit munmap: tensors made by torch.frombuffer keep the mapping alive for as long as any
        # expert view a caller still holds, and it goes when the last one does (unmapping under them crashed).
        self._arena_t = None  # type: ignore[assignment]
        self._arena = None  # type: ignore[assignment]
