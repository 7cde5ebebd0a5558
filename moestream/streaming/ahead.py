"""The prompt read-ahead's reads in flight: the next layer's first uncached experts, started by one layer's
fetch and finished by the next one's (read_ahead.py holds the rule that decides when and how many).

Each expert read ahead is admitted and pinned at once; the next layer's cached experts are pinned too (the
policy's `held` slots), so that the read-ahead evicts none of them. Their reads wait in the reader's buffers
until the next layer's fetch takes them (Fetch), or are dropped when that fetch never comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from moestream.streaming.arena import SlotArena
from moestream.streaming.pending import PendingExpert
from moestream.streaming.read_ahead import ahead_choice, ahead_reads

SEGMENTS = 3  # reads an expert takes one by one (gate, up, down)
# The router lookahead's automatic mode: guessing pays where a decode step waits on reads; where the cache
# holds what decode asks for, a guess only costs the next router's product and the wrong guesses' reads. It
# turns on once recent decode fetches have missed ON_MISSES experts each on average, off again below
# OFF_MISSES (a band, so that it does not flip on every token); each fetch moves the average by 1 - DECAY.
ON_MISSES, OFF_MISSES, DECAY = 1.0, 0.5, 0.8


class GuessSwitch:
    """Whether decode's MoE layers guess the next layer's experts: mode 'on', 'off', or 'auto' (on while recent
    decode fetches miss, see ON_MISSES). Misses count what a fetch reads, guessed reads it takes included, so
    that the guesses' own success does not turn them off."""

    def __init__(self, mode: str = "off"):
        if mode not in ("on", "off", "auto"):
            raise ValueError(f"lookahead mode {mode!r}: expected on, off or auto")
        self.mode = mode
        self.misses = 0.0  # decaying average of a decode fetch's misses
        self.active = mode == "on"

    def observe(self, misses: int) -> None:
        """A decode fetch read `misses` experts."""
        if self.mode != "auto":
            return
        self.misses = DECAY * self.misses + (1 - DECAY) * misses
        self.active = self.misses >= (OFF_MISSES if self.active else ON_MISSES)


class ReadAhead:
    def __init__(self, arena: SlotArena):
        self.arena = arena
        self.pending: dict[tuple[int, int], PendingExpert] = {}  # (layer, expert) -> its reads
        self.layer = -1  # the layer read ahead, -1 if none
        self.guessed: tuple[int, list[int]] | None = None  # (layer, experts) the router lookahead guessed
        self.known: dict[int, list[int]] = {}  # layer -> the experts it will ask for (hash routing), this step

    def start(self, layer: int) -> None:
        """Start reading the first experts of `layer` that are not cached (read_ahead.ahead_choice of them, in
        expert order), each admitted at once, after pinning the layer's cached experts."""
        arena = self.arena
        n_experts, run_len = arena.store.n_experts, arena.reader.run_len
        need = ahead_reads(n_experts, run_len)
        if arena.reader.ahead_buffers() < need:
            raise ValueError(
                f"the read-ahead holds up to {need} reads but the reader spares {arena.reader.ahead_buffers()} "
                "buffers for it; build the reader with planning.read_buffers"
            )
        experts = list(range(n_experts))
        # What it reads waits in the reader's buffers until the layer's fetch (ahead_choice keeps it within the
        # buffers planned for it).
        self._read(layer, experts, lambda fresh: ahead_choice(fresh, n_experts, run_len), prompt=True)

    def next_ids(self, layer: int) -> list[int]:
        """What to read ahead for `layer`: its known experts, else the lookahead's guess (take_guess)."""
        known = self.known.pop(layer, None)
        return known if known is not None else self.take_guess(layer)

    def take_guess(self, layer: int) -> list[int]:
        """The guessed experts of `layer` (none if the guess was for another layer), forgetting the guess."""
        guessed, self.guessed = self.guessed, None
        return guessed[1] if guessed is not None and guessed[0] == layer else []

    def start_ids(self, layer: int, ids: list[int]) -> int:
        """Start reading those of `ids` (experts of `layer`) that are not cached, each admitted at once, as many
        as the reader's spare segment buffers hold (the layer's own fetch takes them, or leaves them cached
        unused); the cached ones are pinned until then, so that these reads evict none of them. Returns how
        many."""
        room = max(0, self.arena.reader.ahead_buffers(runs=False)) // SEGMENTS
        return self._read(layer, ids, lambda fresh: [ids[n] for n in fresh[:room]], prompt=False)

    def _read(self, layer: int, experts: list[int], choose: Callable[[list[int]], Iterable[int]], prompt: bool) -> int:
        """Pin the cached ones of `experts` (layer `layer`), then start reading those `choose` picks from the
        positions of the uncached ones, each admitted at once; returns how many."""
        arena, policy = self.arena, self.arena.policy
        with arena.lock:
            fresh = policy.hold([(layer, e) for e in experts])
            self.layer = layer
            chosen: list[tuple[int, int]] = []
            for e in choose(fresh):
                slot = policy.take(True, spare_free=True)
                if slot is None:
                    break
                policy.place((layer, e), slot)
                chosen.append((e, slot))
            for p in arena.fill_pairs(layer, chosen, prompt=prompt):
                self.pending[(layer, p.expert)] = p
            policy.stats.ahead_reads += len(chosen)
        return len(chosen)

    def take(self) -> list[PendingExpert]:
        """Hand over what is read ahead (to the fetch of its layer, or to drop); the caller holds the lock."""
        pending = list(self.pending.values())
        self.pending, self.layer = {}, -1
        return pending

    def drop(self) -> None:
        """Drop what was read ahead for a layer that will not be fetched next (the forward pass that started it
        was abandoned): its reads are waited for and forgotten, their errors with them, and its pins go."""
        with self.arena.lock:
            ahead = self.take()
            self.arena.policy.release_held()
        for p in ahead:
            self.arena.abandon(p, {})
