"""Everything that configures an engine, in one frozen object: built once by a front-end, recorded in traces."""

from __future__ import annotations

from dataclasses import dataclass

from moestream.errors import MoestreamError

# The option each field is set with on the command line, for errors a user can act on.
_POSITIVE = {
    "ram_budget_mb": "--ram-budget-mb",
    "ctx": "--ctx",
    "threads": "--threads",
    "io_threads": "--io-threads",
    "ubatch": "--ubatch",
    "prefill_span": "--prefill-span",
    "pin_mb": "--pin-mb",
    "keep_free_mb": "--keep-free-mb",
    "max_batch": "--max-batch",
    "longest_prompt": "the prompt's length",
}

# Upper bounds: more is a typo, and would start that many threads or size buffers by it.
_MAXIMUM = {"max_batch": 64, "threads": 1024, "io_threads": 256, "ubatch": 4096, "prefill_span": 1 << 20}


@dataclass(frozen=True)
class EngineOptions:
    # memory
    ram_budget_mb: int | None = None  # None: what the machine has available, minus a margin
    n_slots: int | None = None  # a fixed number of expert slots instead of a budget (tests, benchmarks)
    reserve_mb: int | None = None  # the plan's reserve for what no estimate names (None: the default)
    keep_free_mb: int | None = None  # elastic cache: give slots back when available RAM falls below this
    mlock: bool | None = None  # None: lock the dense weights where RLIMIT_MEMLOCK allows
    # conversations kept across requests (their KV cache) for a prompt that extends one; 0: off; None: the
    # planner's default where the budget affords it (serve, chat)
    prompt_cache_mb: int | None = 0
    # sequences that decode together (serve), each with its own KV cache at ctx, all counted in the plan;
    # None: up to DEFAULT_BATCH where their KV caches take a small share of the budget
    max_batch: int | None = 1
    # compute
    ctx: int | None = None  # None: min(the model's, 4096)
    threads: int | None = None  # None: all cores
    exact: bool | None = None  # None: float32 compute for float files, the quantized kernels otherwise
    ubatch: int | None = None  # None: the largest micro-batch of UBATCH_CHOICES the budget fits
    # prompt tokens that run through every layer at once, each layer's experts read once for all of them
    # (attention in chunks of ubatch). None: the longest span the budget holds (choose_span), the whole
    # prompt with n_slots; the micro-batch: the micro-batch-major path (every micro-batch through every layer)
    prefill_span: int | None = None
    # the longest prompt this engine will prefill, where the caller knows it (run): the span, and the compute
    # buffers the plan sets aside for it, need no more; what they would have taken goes to expert slots or the
    # read-ahead's buffers. A longer prompt still runs, in more spans. None: prompts up to the context.
    longest_prompt: int | None = None
    # reads
    io_threads: int = 4
    direct: bool | None = None  # None: O_DIRECT where the file system allows
    read_ahead: bool = True
    run_reads: bool = True
    # decode: each MoE layer guesses the next one's experts with that layer's router and starts their reads;
    # None: automatically, while decode misses (planning.SlotPlanner.lookahead_mode)
    lookahead: bool | None = None
    # cache policy
    admit_prompt: bool = True
    min_hits: int = 0
    growth_slots: tuple[int, int] | None = None  # LRU growth per prompt micro-batch, per token (None: default)
    pin_profile: str | None = None
    pin_mb: int | None = None
    # observation and experiments
    trace_path: str | None = None
    route_trace: str | None = None
    progress: bool = False
    # the remote expert tier (moestream.distributed): Ray actors on the cluster at ray_address ('local': one
    # started here) holding routed experts in their RAM, up to expert_worker_mb each (None: every expert)
    ray_address: str | None = None
    expert_workers: int | None = None
    expert_worker_mb: int | None = None
    expert_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        """Bad values end here, before any model is loaded, naming the option that set them."""
        for name, option in _POSITIVE.items():
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise MoestreamError(f"{option} must be a positive number, got {value}")
        for name, most in _MAXIMUM.items():
            value = getattr(self, name)
            if value is not None and value > most:
                raise MoestreamError(f"{_POSITIVE[name]} must be at most {most}, got {value}")
        if self.prompt_cache_mb is not None and self.prompt_cache_mb < 0:
            raise MoestreamError(f"--prompt-cache-mb must be 0 or more, got {self.prompt_cache_mb}")
        if (self.ray_address is None) != (self.expert_workers is None):
            raise MoestreamError("--ray and --expert-workers go together: give both (or neither)")
        if self.ray_address is not None and self.ray_address != "local":
            from moestream.distributed.cluster import parse_address

            parse_address(self.ray_address)
        if self.expert_timeout_s <= 0:
            raise MoestreamError(f"the expert workers' timeout must be positive, got {self.expert_timeout_s}")
        if self.expert_workers is not None and not 1 <= self.expert_workers <= 256:
            raise MoestreamError(f"--expert-workers must be from 1 to 256, got {self.expert_workers}")
        if self.expert_worker_mb is not None and (self.expert_worker_mb <= 0 or self.expert_workers is None):
            raise MoestreamError("--expert-worker-mb must be positive, and goes with --ray and --expert-workers")
        if self.min_hits < 0:
            raise MoestreamError(f"--admit-min-hits must be 0 or more, got {self.min_hits}")
