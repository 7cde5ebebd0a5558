"""A fixed number of expert slots in one arena, filled from disk on a miss, evicted least recently used.

The model asks `fetch(layer, ids)` and receives (expert id, weights) pairs as they become available: the
experts already cached first, so it computes them while the missing ones are still being read. An expert
stays pinned from the moment it is requested until the model moves on from it, so nothing a token in flight
needs is ever evicted.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import numpy as np
import torch

from moestream import linear
from moestream.errors import BudgetError
from moestream.expert_store import ExpertStore
from moestream.reader import ExpertReader

Expert = tuple[linear.QLinear, linear.QLinear, linear.QLinear]  # gate, up, down


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_wait_s: float = 0.0  # time the model spent blocked waiting for reads
    evictions: int = 0
    by_phase: dict[str, list[int]] = field(default_factory=lambda: {"prompt": [0, 0], "decode": [0, 0]})

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


# A trace sink receives one record per expert access: (layer, expert, rank = position in the request,
# source 'ram'|'disk', bytes read, read latency in seconds). Disk records arrive when reads complete.
TraceSink = Callable[[int, int, int, str, int, float], None]


class ExpertCache:
    def __init__(self, store: ExpertStore, reader: ExpertReader, n_slots: int):
        if n_slots < 1:
            raise BudgetError("the expert cache needs at least one slot; raise --ram-budget-mb")
        self.store = store
        self.reader = reader
        self.n_slots = n_slots
        self.slot_nbytes = store.slot_nbytes
        # Anonymous mmap: pages are only committed when a slot is first filled, and can be handed back to
        # the OS (madvise) when the cache shrinks.
        self._arena = mmap.mmap(-1, n_slots * self.slot_nbytes)
        self._arena_t = torch.frombuffer(self._arena, dtype=torch.uint8)
        self._experts: list[Expert | None] = [None] * n_slots
        self._key_of: list[tuple[int, int] | None] = [None] * n_slots
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> slot, oldest first
        self._pins = [0] * n_slots
        self._free: deque[int] = deque(range(n_slots))
        self._lock = threading.Lock()
        self.stats = CacheStats()
        self.phase = "decode"
        self.trace: TraceSink | None = None

    # -- slot bookkeeping ------------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for key, slot in self._lru.items():
            if self._pins[slot] == 0:
                del self._lru[key]
                self._key_of[slot] = None
                self._experts[slot] = None
                self.stats.evictions += 1
                return slot
        return None

    def _fill(self, layer: int, expert: int, slot: int) -> tuple[Future, float]:
        """Start the three segment reads of an expert; each packs itself into its part of the slot."""
        layout = self.store.layouts[layer]
        base = slot * self.slot_nbytes
        parts: list[linear.QLinear | None] = [None, None, None]
        futures = []
        off = base
        for i, seg in enumerate(self.store.segments(layer, expert)):
            out = self._arena_t[off : off + layout.packed[i]]
            off += (layout.packed[i] + 63) // 64 * 64

            def consume(raw: memoryview, i=i, seg=seg, out=out) -> None:
                arr = np.frombuffer(raw, dtype=np.uint8)
                parts[i] = linear.pack_into(arr, seg.ggml_type, seg.n, seg.k, out, self.store.exact)

            futures.append(self.reader.submit(seg.offset, seg.nbytes, consume))
        done: Future = Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def on_done(f: Future) -> None:
            exc = f.exception()
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if exc is not None and not done.done():
                done.set_exception(exc)
            elif last and not done.done():
                done.set_result(tuple(parts))

        for f in futures:
            f.add_done_callback(on_done)
        return done, time.perf_counter()

    # -- the model's view ------------------------------------------------------------------------------

    def fetch(self, layer: int, ids: list[int], admit: bool = True) -> Iterator[tuple[int, Expert]]:
        """Yield (expert id, weights) for every id, cached ones first; each stays pinned until the next yield.

        With admit=False, experts read from disk are used once and their slots go straight back to the free
        list, so the access does not push anything out of the cache (the prompt path, when configured so).
        """
        phase = self.stats.by_phase[self.phase]
        hits: list[tuple[int, int]] = []
        pending: deque[int] = deque()
        with self._lock:
            for e in ids:
                key = (layer, e)
                slot = self._lru.get(key)
                if slot is not None:
                    self._lru.move_to_end(key)
                    self._pins[slot] += 1
                    hits.append((e, slot))
                else:
                    pending.append(e)
            self.stats.hits += len(hits)
            self.stats.misses += len(pending)
            phase[0] += len(hits)
            phase[1] += len(pending)
        inflight: dict[Future, tuple[int, int, float]] = {}
        hitq = deque(hits)

        def launch() -> None:
            with self._lock:
                while pending:
                    slot = self._take_slot()
                    if slot is None:
                        break
                    e = pending.popleft()
                    self._pins[slot] += 1
                    if admit:
                        # Admitted in request order, at once: eviction order then depends only on the
                        # sequence of requests, never on which read finished first (replay reproduces it).
                        self._key_of[slot] = (layer, e)
                        self._lru[(layer, e)] = slot
                    fut, t0 = self._fill(layer, e, slot)
                    inflight[fut] = (e, slot, t0)
            if pending and not inflight and not hitq:
                raise BudgetError(
                    f"all {self.n_slots} expert slots are pinned; raise --ram-budget-mb so at least "
                    f"{len(ids)} experts fit"
                )

        try:
            launch()
            while hitq:
                e, slot = hitq.popleft()
                try:
                    if self.trace is not None:
                        self.trace(layer, e, ids.index(e), "ram", 0, 0.0)
                    yield e, self._experts[slot]  # type: ignore[misc]
                finally:
                    self._unpin(slot)
            launch()
            while inflight:
                t_wait = time.perf_counter()
                done, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
                self.stats.read_wait_s += time.perf_counter() - t_wait
                for fut in done:
                    e, slot, t0 = inflight.pop(fut)
                    try:
                        try:
                            experts = fut.result()
                        except BaseException:
                            self._forget(slot)
                            raise
                        nbytes = self.store.expert_file_nbytes[layer]
                        self.stats.bytes_read += nbytes
                        if self.trace is not None:
                            self.trace(layer, e, ids.index(e), "disk", nbytes, time.perf_counter() - t0)
                        with self._lock:
                            self._experts[slot] = experts
                        yield e, experts
                    finally:
                        self._unpin(slot, release=True)  # frees it only if it was not admitted
                launch()
        finally:
            # On an exception or an abandoned generator, wait for reads that still write into slots.
            for fut, (_e, slot, _t0) in list(inflight.items()):
                try:
                    fut.result()
                except Exception:
                    pass
                self._forget(slot)  # never yielded: its contents were not checked, so do not keep them
                self._unpin(slot, release=True)
            for _e, slot in hitq:
                self._unpin(slot)

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
                self._free.append(slot)

    # -- inspection ------------------------------------------------------------------------------------

    def cached_keys(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs held, least recently used first."""
        with self._lock:
            return list(self._lru)

    @property
    def used_slots(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        self._experts = [None] * self.n_slots
        del self._arena_t
        try:
            self._arena.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
