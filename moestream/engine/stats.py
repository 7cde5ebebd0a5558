"""What a generation and the engine report: per-generation stats, the steps of Engine.stream, a snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field

from moestream.streaming.budget import MB


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_wait_s: float = 0.0
    decode_bytes_read: int = 0
    decode_read_wait_s: float = 0.0
    n_slots: int = 0
    peak_rss: int = 0
    finish_reason: str = "length"

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.reused_tokens
        return computed / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def line(self) -> str:
        per_tok = self.decode_bytes_read / MB / self.decode_tokens if self.decode_tokens else 0.0
        wait_ms = 1e3 * self.decode_read_wait_s / self.decode_tokens if self.decode_tokens else 0.0
        tok_ms = 1e3 * self.decode_s / self.decode_tokens if self.decode_tokens else 0.0
        prompt = f"prompt {self.prompt_tokens} tok @ {self.prompt_tps:.1f} tok/s"
        decode = f"decode {self.decode_tokens} tok @ {self.decode_tps:.2f} tok/s ({tok_ms:.1f} ms/tok"
        rss = f"peak RSS {self.peak_rss / MB:.0f} MiB"
        if not self.n_slots:  # a dense model: no expert cache, nothing read
            return f"{prompt} | {decode}) | no experts to stream | {rss}"
        return (
            f"{prompt} | {decode}, {wait_ms:.1f} waiting on reads) | "
            f"expert hit rate {100 * self.hit_rate:.1f}% | disk {per_tok:.1f} MiB/tok | "
            f"cache slots {self.n_slots} | {rss}"
        )


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class GenerationStep:
    """One token of Engine.stream. `stats` is the generation's stats object, kept up to date as it runs;
    finish_reason (stop | length) is set on the last step only."""

    token: int
    stats: GenerationStats
    finish_reason: str | None = None


@dataclass
class EngineSnapshot:
    """The engine's counters since it started (all generations), for status lines, /metrics and stats JSON."""

    model_path: str = ""
    ctx: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    used_slots: int = 0  # slots holding an expert in the LRU part
    n_slots: int = 0  # slots the budget bought
    slot_nbytes: int = 0  # bytes of one slot
    pinned_slots: int = 0
    pinned_hits: int = 0
    read_ahead: bool = False  # whether the prompt read-ahead runs
    ahead_reads: int = 0  # experts it started reading
    ahead_unused: int = 0  # of those, experts the next layer never used
    io_direct: bool = False
    io_threads: int = 0
    read_busy_s: float = 0.0  # time at least one read was in flight
    read_busy_mb_s: float = 0.0  # MB/s over that time
    read_run_len: int = 1  # experts a prompt's run read takes at most (1: no run reads)
    read_buffer_wait_s: float = 0.0  # reads waiting for a free buffer, summed
    prompt_cache_entries: int = 0  # earlier conversations kept for prompts that extend them
    prompt_cache_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
