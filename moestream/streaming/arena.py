"""The expert cache's memory: one anonymous mapping of n_slots equal slots, the experts packed in them, and
the reads that fill them.

Pages are only committed when a slot is first filled (or prefaulted ahead of use), and a slot's pages go
back to the OS when the elastic cache parks it. Which key is in which slot is the SlotPolicy's; this part
knows where each matrix of an expert goes in its slot, starts the reads, and commits or frees the memory.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager

import torch

from moestream.compute import linear
from moestream.compute.experts import ExpertWeights
from moestream.streaming import libc
from moestream.streaming.expert_store import ExpertStore
from moestream.streaming.pending import Int4Halves, LaneHalves, PendingExpert
from moestream.streaming.read_ahead import consecutive_runs
from moestream.streaming.reader import ExpertReader
from moestream.streaming.slot_policy import SlotPolicy

MADV_POPULATE_WRITE = 23  # Linux 5.14+
COMMIT_STEP = 2 << 20  # bytes the prefault commits at a time: a resuming model waits for one such step at most


class CommitGate:
    """When the background commit of the arena's memory may run: while no generation runs, and while a model
    thread blocks on a prompt's expert reads (its core is free then)."""

    def __init__(self) -> None:
        self.idle = threading.Event()  # set while no generation runs
        self.idle.set()
        self.may_commit = threading.Event()
        self.may_commit.set()
        self._reading = 0  # model threads blocked on a prompt's expert reads
        self._lock = threading.Lock()

    def set_idle(self, idle: bool) -> None:
        """No generation runs (True) or one starts (False)."""
        with self._lock:
            (self.idle.set if idle else self.idle.clear)()
            self._update()

    @contextmanager
    def waiting_on_reads(self) -> Iterator[None]:
        """The model thread blocks on a prompt's expert reads inside: the prefault may use its core meanwhile."""
        with self._lock:
            self._reading += 1
            self._update()
        try:
            yield
        finally:
            with self._lock:
                self._reading -= 1
                self._update()

    def _update(self) -> None:
        (self.may_commit.set if self.idle.is_set() or self._reading else self.may_commit.clear)()


class SlotArena:
    """n_slots slots of store.slot_nbytes bytes; `experts[slot]` is the packed expert a slot holds. `lock`
    guards the policy against the elastic watcher's and the prefault's threads."""

    def __init__(self, store: ExpertStore, reader: ExpertReader, policy: SlotPolicy):
        self.store, self.reader, self.policy = store, reader, policy
        self.n_slots = policy.n_slots
        self.slot_nbytes = store.slot_nbytes
        # Private, not Python's default shared mapping: MADV_DONTNEED on shared anonymous memory leaves the
        # pages in shmem, so a shrinking cache gave nothing back (a second process was OOM-killed).
        # (at least a page: a dense model's arena holds no slot, and a mapping cannot be empty)
        size = max(self.n_slots * self.slot_nbytes, mmap.PAGESIZE)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.memory = torch.frombuffer(self._map, dtype=torch.uint8)
        self.experts: list[ExpertWeights | None] = [None] * self.n_slots
        self.lock = threading.RLock()
        self.gate = CommitGate()
        self.closed = False
        self._prefault_thread: threading.Thread | None = None

    # -- filling slots ---------------------------------------------------------------------------------

    def pending(self, layer: int, expert: int, slot: int) -> PendingExpert:
        """An expert about to be read into `slot`: where each of its matrices goes."""
        layout = self.store.layouts[layer]
        base = slot * self.slot_nbytes
        arena = self.memory
        outs = [arena[base + off : base + off + size] for off, size in zip(layout.offsets, layout.packed, strict=True)]
        segs = self.store.segments(layer, expert)
        fused = None
        if layout.fused_gate_up and layout.gate_kind == "lane":
            # lane form: gate rows then up rows are adjacent in the slot, one [2F, row bytes] matrix
            fused = LaneHalves(arena[base : base + 2 * layout.packed[0]].view(2 * segs[0].n, -1))
        elif layout.fused_gate_up:
            # Same bytes as two separate int4 forms: [gate rows | up rows] then their scales side by side.
            n, k = segs[0].n, segs[0].k
            w = arena[base : base + n * k].view(2 * n, k // 2)
            sz_bytes = (k // linear.GROUP) * 2 * n * 2 * 2
            sz = arena[base + n * k : base + n * k + sz_bytes].view(torch.bfloat16).view(k // linear.GROUP, 2 * n, 2)
            fused = Int4Halves(w, sz)
        lane = None
        if layout.all_lane:
            lane = [base + off + libc.memory_of(arena)[0] for off in layout.offsets]
            down = segs[2]
            outs[2] = outs[2].view(down.n, layout.packed[2] // down.n)
        # The reader threads only read; the model's thread packs each segment as it lands, in the prompt too:
        # packing in the reader threads competed with the lane pool for the cores.
        return PendingExpert(layer, expert, slot, segs, outs, [], self.store.exact, fused, lane)

    def fill(self, layer: int, expert: int, slot: int) -> PendingExpert:
        """Start the three segment reads of an expert into pooled buffers; the caller packs them (finish)."""
        p = self.pending(layer, expert, slot)
        return p.started([self.reader.read(seg.offset, seg.nbytes, seg.part) for seg in p.segs])

    def fill_pairs(self, layer: int, pairs: list[tuple[int, int]], prompt: bool) -> list[PendingExpert]:
        """Start reading (expert, slot) pairs: in a prompt consecutive experts together (_fill_run), in decode
        one by one (its few misses are rarely adjacent, and the run buffers are the prompt's)."""
        if not prompt:
            return [self.fill(layer, e, slot) for e, slot in pairs]
        runs = consecutive_runs(pairs, self.reader.run_len, key=lambda pair: pair[0])
        return [p for run in runs for p in self._fill_run(layer, run)]

    def _fill_run(self, layer: int, run: list[tuple[int, int]]) -> list[PendingExpert]:
        """Start reading (expert, slot) pairs of consecutive experts: each of the three matrices of the whole
        run is one read (they are adjacent in the file), handed over expert by expert. The run lies in one merged
        tensor, and a tensor in one file of a split model, so a run read never spans two files."""
        first = self.store.segments(layer, run[0][0])
        runs = [self.reader.read_run(seg.offset, seg.nbytes, len(run), seg.part) for seg in first]
        return [self.pending(layer, e, slot).started([r[j] for r in runs]) for j, (e, slot) in enumerate(run)]

    def finish(self, p: PendingExpert) -> ExpertWeights:
        """Wait for an expert's reads (within the reader's deadline) and pack them."""
        if wait(p.futures, timeout=self.reader.wait_s).not_done:
            raise self.reader.error(f"an expert's reads did not finish within {self.reader.wait_s:g} s")
        return p.finish()

    def abandon(self, p: PendingExpert, inflight: dict[Future, PendingExpert]) -> None:
        """Drop an expert whose reads failed or are no longer wanted: release its buffers and its slot (once:
        an error path may reach the same expert twice, by two of its segments)."""
        if p.abandoned:
            return
        p.abandoned = True
        for fut in p.futures:
            inflight.pop(fut, None)
        p.drain()
        with self.lock:
            self.policy.forget(p.slot)  # never yielded: its contents were not checked, so do not keep them
            self.unpin(p.slot, release=True)

    def unpin(self, slot: int, release: bool = False) -> None:
        """A fetch is done with a slot; release: a slot that holds no key (not admitted, forgotten) is free."""
        with self.lock:
            self.policy.unpin(slot, release)
            if release and self.policy.key_of[slot] is None:
                self.experts[slot] = None

    # -- memory ----------------------------------------------------------------------------------------

    def prefault(self, background: bool = True) -> threading.Thread | None:
        """Commit the arena's pages ahead of use (MADV_POPULATE_WRITE, in chunks, off the model's thread).

        A slot's first fill otherwise takes its page faults inside the pack, most of a cold cache's miss
        cost. Only worth it when the user gave the budget: the memory is promised to the cache anyway; fills
        before it is done fault as usual. While the model generates it commits only while a prompt waits on
        expert reads (CommitGate.waiting_on_reads: a core is free then): committing fresh memory under a
        running model slows it, a decode step's many short waits included (SlotPolicy.begin_step: how the
        cache grows meanwhile). Slots already filled are skipped, so that it works ahead of the fills; it
        stops within a COMMIT_STEP of the model resuming.
        """
        if not background:
            self._prefault()
            return None
        t = threading.Thread(target=self._prefault, name="moestream-prefault", daemon=True)
        t.start()
        self._prefault_thread = t
        return t

    def _prefault(self) -> None:
        base = libc.memory_of(self.memory)[0]
        stats = self.policy.stats
        step = max(mmap.PAGESIZE, min(COMMIT_STEP, self.slot_nbytes) // mmap.PAGESIZE * mmap.PAGESIZE)
        for slot in range(self.n_slots):
            for off in range(0, self.slot_nbytes, step):
                self.gate.may_commit.wait()
                # Stop as soon as the elastic cache has had to give memory back: prefaulting would take it again.
                if self.closed or stats.shrinks:
                    return
                if off == 0:
                    with self.lock:
                        skip = slot in self.policy.parked or self.experts[slot] is not None
                    if skip:
                        break  # parked (its memory given back) or already filled
                n = min(step, self.slot_nbytes - off)
                if libc.madvise(base + slot * self.slot_nbytes + off, n, MADV_POPULATE_WRITE) != 0:
                    return  # kernel before 5.14: pages fault in on first use, as without prefaulting

    def wait_prefault(self) -> None:
        """Block until a background prefault has committed the arena (benchmarks that time a committed cache)."""
        if self._prefault_thread is not None:
            self._prefault_thread.join()

    def release_memory(self, slot: int) -> None:
        """A parked slot's pages go back to the OS (nothing is paged out)."""
        self.experts[slot] = None
        self._map.madvise(mmap.MADV_DONTNEED, slot * self.slot_nbytes, self.slot_nbytes)

    def close(self) -> None:
        self.closed = True
        self.gate.set_idle(True)  # a waiting prefault sees closed and ends
        if self._prefault_thread is not None:
            self._prefault_thread.join()  # it stops at the next chunk
        self.experts = [None] * self.n_slots
        # No explicit munmap: tensors made by torch.frombuffer keep the mapping alive for as long as any
        # expert view a caller still holds, and it goes when the last one does (unmapping under them crashed).
        self.memory = None  # type: ignore[assignment]
        self._map = None  # type: ignore[assignment]
