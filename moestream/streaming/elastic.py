"""The elastic expert cache: give RAM back when other programs need it, take it again when they are done.

A watcher reads the available memory (MemAvailable, capped by the cgroup limit) a few times a second.
Below the floor the user asked to keep free, it frees the coldest LRU slots at once (madvise: the pages go
back to the OS, nothing is paged out); with memory free again it grows back one step at a time. It never
goes below what one token needs. This follows the Strata MoE runtime's watcher, which replaced per-buffer offers
that halved decode speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from moestream.streaming.budget import MB, available_bytes
from moestream.streaming.expert_cache import ExpertCache

GROW_STEP_MB = 256  # Strata grows a GiB at a time on 64 GB machines; our users have 8-32 GB


class ElasticWatcher:
    def __init__(
        self,
        cache: ExpertCache,
        keep_free_mb: int,
        interval_s: float = 0.1,
        available: Callable[[], int] = available_bytes,
        grow_step_mb: int = GROW_STEP_MB,
        cooldown_s: float = 5.0,
        overshoot_slots: int | None = None,
    ):
        self.cache = cache
        self.keep_free = keep_free_mb * MB
        self.interval_s = interval_s
        self.available = available
        self.grow_step = max(1, grow_step_mb * MB // cache.slot_nbytes)
        self.events: list[tuple[str, int, int]] = []  # (action, slots, available bytes)
        self.last_error: str | None = None
        self.cooldown_s = cooldown_s
        self.overshoot = overshoot_slots if overshoot_slots is not None else self.grow_step
        self._last_shrink = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moestream-elastic", daemon=True)

    def start(self) -> ElasticWatcher:
        self._thread.start()
        return self

    def step(self) -> int:
        """One look at the available memory; returns slots released (<0) or regained (>0)."""
        avail = self.available()
        slot = self.cache.slot_nbytes
        now = time.monotonic()
        if avail < self.keep_free:
            # Give back a grow step more than the shortfall: a program that is taking memory usually takes
            # more before the next reading, and the floor should absorb it rather than the OOM killer.
            n = self.cache.shrink(-(-(self.keep_free - avail) // slot) + self.overshoot)
            if n:
                self.events.append(("shrink", n, avail))
                self._last_shrink = now
            return -n
        # Grow only when a whole step fits above the floor, and not while another program is still taking
        # memory: growing between its allocations let the cache refill at once and that program was
        # OOM-killed on its next step (bench/elastic_pressure.py).
        room = (avail - self.keep_free) // slot
        if room >= self.grow_step and now - self._last_shrink >= self.cooldown_s:
            n = self.cache.grow(self.grow_step)
            if n:
                self.events.append(("grow", n, avail))
            return n
        return 0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception as exc:  # the watcher must outlive a bad reading; say what happened
                self.events.append(("error", 0, 0))
                self.last_error = repr(exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def summary(self) -> str:
        st = self.cache.stats
        return (
            f"elastic: {st.shrinks} shrinks ({st.slots_released} slots given back), {st.grows} grows; "
            f"now {self.cache.capacity} of {self.cache.n_slots} slots"
        )
