"""One fetch of a layer's experts: start the misses' reads, wait for them, deliver the experts in groups.

The hits come first, as one group, so the model computes them while the misses are still being read; then
the misses as their reads complete (those that complete together in one group). A group stays pinned until
the next one is asked for, so the model can compute a whole group in one kernel call.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import nullcontext
from typing import TYPE_CHECKING

from moestream.compute.experts import ExpertWeights
from moestream.errors import BudgetError
from moestream.streaming.pending import PendingExpert, pack_lanes
from moestream.streaming.read_ahead import reads_ahead
from moestream.streaming.reader import Lease

if TYPE_CHECKING:
    from moestream.streaming.expert_cache import ExpertCache

# an ordered fetch keeps its order where the cache may hold this many times its request (Fetch)
ORDERED_ROOM = 2

Group = list[tuple[int, ExpertWeights]]


class Fetch:
    """fetch_groups(layer, ids) of one cache, as an object: its hits (pinned), the misses waiting for a slot,
    the reads in flight, and, ordered, what waits for an earlier id.

    With admit=False, experts read from disk are used once and their slots go straight back to the free
    list, so the access does not push anything out of the cache (the prompt path, when configured so).

    ordered=True yields in the order of `ids` instead (a long prompt span: the model then sums each expert's
    rows into the output as it comes, instead of holding every (token, expert) result until the last one),
    where the cache may grow to twice the request (ORDERED_ROOM): what waits for an earlier miss then stays
    pinned without changing what the cache evicts, so its decisions (and the replay of its trace) are those
    of the unordered fetch. A smaller cache, or one that does not admit what it reads, yields as the reads
    complete. Should the slots still run out, a group comes early, out of order.
    """

    def __init__(self, cache: ExpertCache, layer: int, ids: list[int], admit: bool, ordered: bool):
        self.cache, self.arena, self.policy = cache, cache.arena, cache.policy
        self.layer, self.ids, self.admit, self.ordered = layer, ids, admit, ordered

    def _begin(self) -> None:
        """The request's start, when its first group is asked for (a fetch never iterated does nothing)."""
        cache, layer, ids, admit = self.cache, self.layer, self.ids, self.admit
        if cache.ahead.layer >= 0 and cache.ahead.layer != layer:
            cache.ahead.drop()  # read ahead for a layer this call is not: an abandoned forward pass
        self.prompt = cache.phase == "prompt"
        self.refresh = self.policy.admission.refreshes(self.prompt, admit)
        room = ORDERED_ROOM * len(ids)
        self.ordered = self.ordered and self.refresh and self.policy.admission.min_hits == 0
        self.ordered = self.ordered and self.policy.room() >= room
        self.inflight: dict[Future, PendingExpert] = {}  # segment read -> the expert it belongs to
        self.completed: queue.SimpleQueue[Future] = queue.SimpleQueue()  # reads as they finish
        taken, unused = self._request()
        for p in (*taken, *unused):
            self._watch(p)
        self.unused = {id(p) for p in unused}  # read ahead but not asked for: finished here, not yielded
        # ordered: what is in hand but waits for an earlier id (request position -> expert id, slot, read)
        self.held: dict[int, tuple[int, int, bool]] = {}
        self.position = {e: i for i, e in enumerate(ids)} if self.ordered else {}
        self.next_pos = 0
        self.early: set[int] = set()  # positions yielded ahead of their turn

    def _request(self) -> tuple[list[PendingExpert], list[PendingExpert]]:
        """The hit pass: hits pinned, misses queued; of what was read ahead, the reads this fetch asked for
        (misses all the same) and those it did not."""
        stats, ids, layer = self.policy.stats, self.ids, self.layer
        keys = [(layer, e) for e in ids]
        with self.arena.lock:
            ahead = self.cache.ahead.pending
            req = self.policy.request(keys, self.refresh, ahead)
            taken: list[PendingExpert] = []
            unused: list[PendingExpert] = []
            if self.cache.ahead.layer >= 0:
                taken = [ahead.pop(keys[n]) for n in req.ahead]
                unused = self.cache.ahead.take()
            if self.policy.held:
                self.policy.release_held()  # this call's own pins are in place
            stats.hits += len(req.hits)
            stats.misses += len(req.missed) + len(taken)
            phase = stats.by_phase[self.cache.phase]
            phase[0] += len(req.hits)
            phase[1] += len(req.missed) + len(taken)
            if self.cache.phase == "decode":
                self.cache.guesses.observe(len(req.missed) + len(taken))
            stats.ahead_unused += len(unused)
        self.hitq = deque((ids[n], slot) for n, slot in req.hits)
        self.pending = deque(ids[n] for n in req.missed)
        return taken, unused

    def groups(self) -> Iterator[Group]:
        self._begin()
        try:
            self._launch()
            if self._reads_ahead():
                self.cache.ahead.start(self.layer + 1)
            elif nxt := self.cache.ahead.next_ids(self.layer + 1):
                self.cache.ahead.start_ids(self.layer + 1, nxt)
            trace = self.cache.trace
            if self.hitq and trace is not None:
                for e, _slot in self.hitq:
                    trace(self.layer, e, self.ids.index(e), "ram", 0, 0.0)
            yield from self._hits()
            self._launch()
            while self.inflight or (self.ordered and (self.held or self.pending)):
                if self.ordered and not self.inflight:
                    # the next id waits for a slot that what is held pins: yield it early, out of order
                    yield from self._yield_held(self._in_order(all_held=True))
                    self._launch()
                    continue
                ready: list[PendingExpert] = []
                try:
                    self._deliver(self._wait(), ready)
                    if self.ordered:
                        for p in ready:
                            self.held[self.position[p.expert]] = (p.expert, p.slot, True)
                        ready.clear()
                    elif ready:
                        yield [(p.expert, self.arena.experts[p.slot]) for p in ready]  # type: ignore[misc]
                finally:
                    for p in ready:
                        self.arena.unpin(p.slot, release=True)  # frees it only if it was not admitted
                if self.ordered:
                    yield from self._yield_held(self._in_order())
                self._launch()
        finally:
            self._settle()

    def _hits(self) -> Iterator[Group]:
        """The hits, as one group (ordered: those in turn; the rest wait in `held`)."""
        hitq = self.hitq
        if self.ordered:
            while hitq:
                e, slot = hitq.popleft()
                self.held[self.position[e]] = (e, slot, False)
            yield from self._yield_held(self._in_order())
        if hitq:
            group = [(e, self.arena.experts[slot]) for e, slot in hitq]
            try:
                yield group  # type: ignore[misc]
            finally:
                while hitq:
                    self.arena.unpin(hitq.popleft()[1])

    def _settle(self) -> None:
        """On the end, an exception or an abandoned generator: drain reads that still hold buffers and slots,
        unpin what was not yielded, and count the accesses."""
        for p in {id(p): p for p in self.inflight.values()}.values():
            self.arena.abandon(p, self.inflight)
        for _e, slot in self.hitq:
            self.arena.unpin(slot)
        for _e, slot, read in self.held.values():
            self.arena.unpin(slot, release=read)
        if self.policy.admission.min_hits > 0:
            self.policy.admission.count([(self.layer, e) for e in self.ids])

    def _reads_ahead(self) -> bool:
        """Whether this fetch also starts reading the next layer (read_ahead.reads_ahead)."""
        store = self.cache.store
        return (
            self.cache.read_ahead
            and self.refresh
            and self.prompt
            and self.policy.admission.min_hits == 0
            and not self.pending
            and self.layer + 1 < store.n_layers
            and reads_ahead(len(self.ids), store.n_experts, self.policy.room())
        )

    def _launch(self) -> None:
        """Start the reads of the misses that get a slot now, in request order."""
        policy, layer, pending = self.policy, self.layer, self.pending
        started: list[tuple[int, int]] = []  # (expert, slot)
        with self.arena.lock:
            while pending:
                admitted = policy.admission.admits((layer, pending[0]), self.prompt, self.admit)
                slot = policy.take(admitted, spare_free=True)
                if slot is None:
                    break
                e = pending.popleft()
                # Admitted in request order, at once: eviction order then depends only on the sequence of
                # requests, never on which read finished first (replay reproduces it).
                policy.place((layer, e), slot, admitted)
                started.append((e, slot))
            for p in self.arena.fill_pairs(layer, started, self.prompt):
                self._watch(p)
        if pending and not self.inflight and not self.hitq and not self.held:
            raise BudgetError(
                f"all {policy.n_slots} expert slots are pinned; raise --ram-budget-mb so at least "
                f"{len(self.ids)} experts fit"
            )

    def _watch(self, p: PendingExpert) -> None:
        for fut in p.futures:
            self.inflight[fut] = p
            fut.add_done_callback(self.completed.put)

    def _wait(self) -> list[Future]:
        """The reads that finished (at least one), within the reader's deadline."""
        reader = self.cache.reader
        # A completion queue, not concurrent.futures.wait: that re-registers a waiter on every future in
        # flight per call, quadratic over a prompt layer's segment reads.
        t_wait = time.perf_counter()
        try:
            # a prompt's waits lend the core to the cache's commit; a decode step's do not: its many short waits
            # then ran slower (bench/RESULTS.md, the commit while waiting on reads)
            with self.arena.gate.waiting_on_reads() if self.cache.phase == "prompt" else nullcontext():
                done = [self.completed.get(timeout=reader.wait_s)]
        except queue.Empty:
            raise reader.error(
                f"no expert read finished within {reader.wait_s:g} s; the disk is not responding"
            ) from None
        self.policy.stats.read_wait_s += time.perf_counter() - t_wait
        while not self.completed.empty():
            done.append(self.completed.get_nowait())
        return [f for f in done if f in self.inflight]  # reads of an expert abandoned meanwhile

    def _deliver(self, done: list[Future], ready: list[PendingExpert]) -> None:
        """Pack the finished reads into their slots (the lane form's together, in one native call); the
        experts now whole go to `ready`."""
        lanes: list[tuple[PendingExpert, int, Lease]] = []
        packed = False
        try:
            for fut in done:
                p = self.inflight.pop(fut)
                try:
                    if p.lane is not None:
                        lanes.append(p.take(fut))
                        continue
                    experts = p.segment_done(fut)
                except BaseException:
                    self.arena.abandon(p, self.inflight)
                    raise
                self._complete(p, experts, ready)
            packed = True
            if lanes:
                pack_lanes(lanes)  # gives the leases back, whatever happens
        except BaseException:
            if not packed:
                for _, _, lease in lanes:
                    lease.release()
            for p in {id(p): p for p, _, _ in lanes}.values():
                self.arena.abandon(p, self.inflight)
            raise
        for p, _, _ in lanes:
            self._complete(p, p.lane_done(), ready)

    def _complete(self, p: PendingExpert, experts: ExpertWeights | None, ready: list[PendingExpert]) -> None:
        """A read expert's bookkeeping once its last segment is packed."""
        if experts is None:
            return  # other segments of this expert are still being read
        nbytes = self.cache.store.expert_file_nbytes[self.layer]
        self.policy.stats.bytes_read += nbytes
        with self.arena.lock:
            self.arena.experts[p.slot] = experts
        if id(p) in self.unused:  # read ahead, not asked for: cached, not yielded
            self.arena.unpin(p.slot)
            return
        ready.append(p)
        if self.cache.trace is not None:
            self.cache.trace(self.layer, p.expert, self.ids.index(p.expert), "disk", nbytes, p.latency())

    def _in_order(self, all_held: bool = False) -> list[tuple[int, int, bool]]:
        """The held experts to yield now: those from next_pos on without a gap (every one if all_held)."""
        held = self.held
        if all_held:
            self.early.update(held)
            return [held.pop(i) for i in sorted(held)]
        run = []
        while self.next_pos in held or self.next_pos in self.early:
            if self.next_pos in held:
                run.append(held.pop(self.next_pos))
            self.next_pos += 1
        return run

    def _yield_held(self, run: list[tuple[int, int, bool]]) -> Iterator[Group]:
        """Yield `run` (expert id, slot, whether it was read) as one group, then unpin it (a read's slot freed
        if it was not admitted), whatever the consumer does."""
        if not run:
            return
        try:
            yield [(e, self.arena.experts[slot]) for e, slot, _read in run]  # type: ignore[misc]
        finally:
            for _e, slot, read in run:
                self.arena.unpin(slot, release=read)
