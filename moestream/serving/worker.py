"""The one thread that runs the engine for the HTTP server: its jobs, the batch they decode in, its metrics.

Requests decode together (engine/scheduler.py): each step takes one token from every admitted request, whose
prompt, KV cache, sampling and stops are its own. A request that finds every sequence slot taken waits in a
bounded queue (beyond it the server answers 429); each slot keeps its last conversation, so a follow-up turn
only computes its new tokens. Tokens travel from the worker to the request's asyncio task through a
thread-safe hand-off; a client that goes away sets the job's `cancelled` flag, and the worker ends that
request at the next step without disturbing the others. Each job's TextStream turns its tokens into its
answer's pieces here (so a stop string ends generation at once). A request with n > 1 choices runs them as one
group of sequences (engine/scheduler.py), each choice with its own sampler and TextStream; its events carry the
choice's index. The worker logs one line per finished request (ids and counts, never the prompt's text).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from moestream.engine.grammar import TokenGrammar
from moestream.engine.sampling import Sampler, TokenLogprobs
from moestream.engine.scheduler import Sequence, TokenEvent
from moestream.errors import ContextError, DiskError
from moestream.serving.answer import usage_of
from moestream.serving.schemas import APIError
from moestream.serving.text import Piece, TextStream
from moestream.streaming.budget import rss_bytes

FILE_CHECK_S = 5.0  # how often an idle server checks that its model file is unchanged
DEFAULT_MAX_QUEUE = 64  # requests waiting for a sequence slot before the server answers 429
DEFAULT_GATHER_MS = 300
# Requests that arrive together reach the worker tens of milliseconds apart (each client builds its request,
# the server parses and templates it; at 25 ms a benchmark's fourth client still missed the step). The worker
# waits while they keep coming, this much after the last one, so that a burst starts in one step: a prompt
# step that set off with the first request alone would make the others wait for its whole pass over the
# experts, which under memory pressure is a read of most of the file.
GATHER_GAP_S = 0.1
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# uvicorn's own log: its handler writes to stderr at the server's --log-level
LOG = logging.getLogger("uvicorn.error")


def _unavailable(reason: str) -> APIError:
    return APIError(503, f"the server cannot answer any more: {reason}", type="server_error")


@dataclass(frozen=True)
class Admission:
    """How requests get into the batch: the queue's bound and how long a burst of arrivals is gathered."""

    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting for a sequence slot; beyond them 429
    gather_s: float = DEFAULT_GATHER_MS / 1000  # longest wait for the rest of a burst (0: step at once)
    gather_gap_s: float = GATHER_GAP_S  # a burst ends when nothing more arrived for this long


@dataclass
class TextEvent:
    pieces: list[Piece]  # possibly none: the token's text is held back by the answer's parser
    index: int = 0  # the choice
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of the tokens since the last event


@dataclass
class DoneEvent:
    finish_reason: str  # stop | length | cancelled | tool_calls
    usage: dict[str, Any]  # the whole request's, on its final event
    index: int = 0
    final: bool = True  # the request's last choice to finish


@dataclass
class ErrorEvent:
    error: APIError


Event = TextEvent | DoneEvent | ErrorEvent


@dataclass(eq=False)
class Job:
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    text: TextStream  # its tokens -> its answer; used by the worker thread only
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    others: list[tuple[Sampler, TextStream]] = field(default_factory=list)  # choices 1.. of a request with n > 1
    top_logprobs: int | None = None  # None: no log-probabilities
    request_id: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    grammars: list[TokenGrammar | None] = field(default_factory=list)  # each choice's (serving/structured.py)

    @property
    def choices(self) -> list[tuple[Sampler, TextStream]]:
        return [(self.sampler, self.text), *self.others]

    def emit(self, event: Event) -> None:
        """Called from the worker thread: hand the event to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


@dataclass
class Metrics:
    requests: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0  # refused with 429: the queue was full
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0  # time spent in steps
    last_prompt_tps: float = 0.0
    last_decode_tps: float = 0.0
    request_s: float = 0.0  # recent requests' time from admission to end (moving average), for Retry-After


class ModelFileWatch:
    """Whether the model file is still the one whose weights are resident; once it changed (`fatal` says
    how), nothing more can be answered."""

    def __init__(self, engine: Any, on_fatal: Callable[[str], None] | None):
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal: str | None = None

    def check(self) -> bool:
        """False (and the server winds down) when the model file changed under the process."""
        if self.fatal is not None:
            return False
        try:
            self.engine.check_model_file()
        except DiskError as exc:
            self.fatal = str(exc)
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)
            return False
        return True

    def error(self, exc: Exception) -> APIError:
        """What a client is told of a failure: 503 once the model file changed; only a request that cannot fit
        is the client's fault (400), a model or disk failure is the server's (500)."""
        if not self.check():
            return _unavailable(self.fatal or str(exc))
        if isinstance(exc, ContextError):
            return APIError(400, f"generation failed: {exc}")
        return APIError(500, f"generation failed: {exc}", type="server_error")


def _burst(
    jobs: queue.Queue[Job | None], first: Job | None, admission: Admission, gather: bool
) -> Iterator[Job | None]:
    """The first arrival and those that follow it closely (gather_gap_s apart, gather_s at most). gather
    False (streams are decoding): only what has already arrived, so that a running stream never waits for a
    burst; the next step, moments away, admits them together anyway."""
    end = time.monotonic() + (admission.gather_s if gather else 0.0)
    job: Job | None = first
    while True:
        yield job
        if job is None:
            return
        wait = min(end - time.monotonic(), admission.gather_gap_s)
        try:
            job = jobs.get(timeout=wait) if wait > 0 else jobs.get_nowait()
        except queue.Empty:
            return


@dataclass(eq=False)
class _Request:
    """A job's sequences (one per choice) and how far they got."""

    job: Job
    seqs: list[Sequence]
    reasons: dict[int, str] = field(default_factory=dict)  # finished choices' finish reasons
    first_token: float = 0.0  # when its first token was generated

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: the prompt (and what of it was cached) once, the tokens of every choice."""
        usage = usage_of(self.seqs[0].stats)
        usage["completion_tokens"] = sum(s.stats.decode_tokens for s in self.seqs)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        st, decode_s = self.seqs[0].stats, max(s.stats.decode_s for s in self.seqs)  # llama.cpp's names
        usage["timings"] = {"prompt_n": st.prompt_tokens - st.reused_tokens,
                            "prompt_ms": round(st.prompt_s * 1000, 3), "predicted_n": usage["completion_tokens"],
                            "predicted_ms": round(decode_s * 1000, 3)}  # fmt: skip
        return usage

    def log_line(self, outcome: str) -> str:
        st = self.seqs[0].stats
        made = sum(s.stats.decode_tokens for s in self.seqs)
        decode_s = max(s.stats.decode_s for s in self.seqs)
        ttft = f"{self.first_token - self.job.submitted:.3f} s" if self.first_token else "-"
        return (
            f"request {self.job.request_id or '-'}: prompt {st.prompt_tokens} tok ({st.reused_tokens} cached) | "
            f"generated {made} tok | first token {ttft} | decode {made / decode_s if decode_s > 0 else 0.0:.2f} "
            f"tok/s | finish {outcome}"
        )


@dataclass(eq=False)
class _Active:
    request: _Request
    index: int  # its choice
    admitted: bool = False
    pending: list[TokenLogprobs] = field(default_factory=list)  # not sent yet: their text is held back

    @property
    def job(self) -> Job:
        return self.request.job


class Worker:
    """The one thread that touches the engine. Requests take sequence slots in arrival order (FIFO is fair)."""

    def __init__(
        self,
        engine: Any,
        on_fatal: Callable[[str], None] | None = None,
        check_every_s: float = FILE_CHECK_S,
        admission: Admission = Admission(),
    ):
        self.engine = engine
        self.batch = engine.scheduler()
        self.admission = admission
        self.jobs: queue.Queue[Job | None] = queue.Queue()  # submitted, not yet seen by the worker
        self.active: dict[Sequence, _Active] = {}
        self._lock = threading.Lock()
        self._waiting: set[Job] = set()  # submitted and not yet holding a sequence slot
        self._holding: set[Job] = set()  # holding a sequence slot
        self.metrics = Metrics()
        self.file = ModelFileWatch(engine, on_fatal)
        self.check_every_s = check_every_s
        self.thread = threading.Thread(target=self._loop, name="moestream-engine", daemon=True)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self.batch.running)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise APIError 429 when --max-queue requests already wait for a slot."""
        if self.file.fatal is not None:
            job.emit(ErrorEvent(_unavailable(self.file.fatal)))
            return
        with self._lock:
            free = self.batch.capacity - sum(len(j.choices) for j in self._holding)  # a job holds a slot per choice
            if len(self._waiting) >= self.admission.max_queue + free:
                self.metrics.rejected += 1
                retry = max(1, math.ceil(self.metrics.request_s))
                raise APIError(
                    429,
                    f"the server is busy: {len(self._holding)} requests are generating and {len(self._waiting)} "
                    f"wait for a slot (--max-queue {self.admission.max_queue}); retry in about {retry} s",
                    type="server_error",
                    code="queue_full",
                    headers={"Retry-After": str(retry)},
                )
            self._waiting.add(job)
        self.jobs.put(job)

    def cancel_all(self) -> None:
        """Stop every running and queued job (the server is shutting down)."""
        with self._lock:
            jobs = [*self._waiting, *(a.job for a in list(self.active.values()))]
        for job in jobs:
            job.cancelled.set()

    def stop(self) -> None:
        self.cancel_all()
        self.jobs.put(None)  # after the cancelled jobs, each of which ends at once
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            try:
                # block only while nothing is generating; else take what arrived and step
                job = self.jobs.get(timeout=self.check_every_s) if not self.batch else self.jobs.get_nowait()
            except queue.Empty:
                if not self.batch:  # idle: make sure the file is still the one whose weights are resident
                    self.file.check()
                    continue
                job = False
            if job is not False:
                for arrival in _burst(self.jobs, job, self.admission, gather=not self.batch):
                    if arrival is None:
                        self._cancel(everything=True)  # the server stops: whatever is left ends as cancelled
                        return
                    self._add(arrival)
            self._cancel()
            if self.batch:
                self._step()

    def _add(self, job: Job) -> None:
        fatal = self.file.fatal
        if job.cancelled.is_set() or fatal is not None:  # the client left while queued, or no more answers
            self._unqueue(job)
            self.metrics.requests += 1
            if fatal is not None:
                job.emit(ErrorEvent(_unavailable(fatal)))
            else:
                self.metrics.cancelled += 1
                job.emit(DoneEvent("cancelled", {}))
            return
        self.metrics.requests += 1
        try:
            samplers = [sampler for sampler, _ in job.choices]
            stops = self.engine.tokenizer.stop_ids
            extra = {"grammars": job.grammars} if any(job.grammars) else {}
            seqs = self.batch.add_choices(
                job.prompt, job.max_tokens, samplers, stops, top_logprobs=job.top_logprobs, **extra
            )
        except Exception as exc:  # a prompt that cannot fit, or a model file that changed
            self._unqueue(job)
            self.metrics.failed += 1
            job.emit(ErrorEvent(self.file.error(exc)))
            return
        request = _Request(job, seqs)
        for i, seq in enumerate(seqs):
            self.active[seq] = _Active(request, i)

    def _unqueue(self, job: Job) -> None:
        with self._lock:
            self._waiting.discard(job)
            self._holding.discard(job)

    def _cancel(self, everything: bool = False) -> None:
        """End the requests whose clients left (or all of them) as cancelled."""
        for seq, act in list(self.active.items()):
            if everything or act.job.cancelled.is_set():
                self.batch.cancel(seq)
                self._done(seq, "cancelled")

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            events = self.batch.step()
        except Exception as exc:  # every failure must reach the clients, not kill the worker
            # its sequences end (their KV caches forgotten); the queued ones go on if the file is still good
            self._fail(self.batch.fail_running(), self.file.error(exc))
            return
        finally:
            self.metrics.busy_s += time.perf_counter() - t0
        for seq, act in self.active.items():
            if not act.admitted and seq.conversation is not None:
                act.admitted = True
                with self._lock:
                    self._waiting.discard(act.job)
                    self._holding.add(act.job)
        for ev in events:
            self._deliver(ev)

    def _deliver(self, ev: TokenEvent) -> None:
        seq, act = ev.sequence, self.active[ev.sequence]
        job, text = act.job, act.job.choices[act.index][1]
        act.request.first_token = act.request.first_token or time.perf_counter()
        try:
            delta = text.add(ev.token, ev.finish_reason)
        except Exception as exc:  # an answer the parser chokes on fails its request, not the worker
            if ev.finish_reason is None:
                self.batch.cancel(seq)
            self._fail([seq], self.file.error(exc))
            return
        if text.stopped and ev.finish_reason is None:
            self.batch.cancel(seq, "stop")  # a stop string ends generation at once
        if ev.logprobs is not None and ev.token not in seq.stop_ids:  # an end token is no part of the answer
            act.pending.append(ev.logprobs)
        if delta.pieces or (act.pending and text.finish_reason is not None):
            job.emit(TextEvent(delta.pieces, act.index, act.pending))
            act.pending = []
        if text.finish_reason is not None:
            self._done(seq, text.finish_reason)

    def _done(self, seq: Sequence, reason: str) -> None:
        act = self.active.pop(seq)
        req, m, st = act.request, self.metrics, seq.stats
        req.reasons[act.index] = reason
        m.generated_tokens += st.decode_tokens
        final = len(req.reasons) == len(req.seqs)
        if not final:
            act.job.emit(DoneEvent(reason, {}, act.index, final=False))
            return
        self._unqueue(act.job)
        first = req.seqs[0].stats
        if "cancelled" in req.reasons.values():
            m.cancelled += 1
        m.prompt_tokens += first.prompt_tokens
        m.cached_tokens += first.reused_tokens
        m.last_prompt_tps, m.last_decode_tps = first.prompt_tps, st.decode_tps
        if seq.started:
            m.request_s = 0.8 * m.request_s + 0.2 * (time.perf_counter() - seq.started)
        LOG.info(req.log_line(",".join(req.reasons[i] for i in sorted(req.reasons))))
        act.job.emit(DoneEvent(reason, req.usage(), act.index))

    def _fail(self, failed: list[Sequence], error: APIError) -> None:
        """End these sequences' requests with an error (the other choices of such a request end with it)."""
        for seq in failed:
            act = self.active.pop(seq, None)
            if act is None:  # a choice of a request failed already
                continue
            for other in act.request.seqs:
                if other in self.active:
                    self.batch.cancel(other)
                    del self.active[other]
            self._unqueue(act.job)
            self.metrics.failed += 1
            LOG.info(act.request.log_line("error"))
            act.job.emit(ErrorEvent(error))


def metrics_text(worker: Worker) -> str:
    """Prometheus text exposition format."""
    m = worker.metrics
    e = worker.engine.snapshot()
    rows = [
        ("requests_total", "counter", "requests taken by the engine worker", m.requests),
        ("requests_cancelled_total", "counter", "requests stopped because the client went away", m.cancelled),
        ("requests_failed_total", "counter", "requests whose generation raised an error", m.failed),
        ("requests_rejected_total", "counter", "requests refused with 429: the queue was full", m.rejected),
        ("requests_queued", "gauge", "requests waiting for a sequence slot", worker.queued),
        ("requests_running", "gauge", "requests holding a sequence slot", worker.running),
        ("sequence_slots", "gauge", "requests that can generate together (--max-batch)", worker.batch.capacity),
        ("prompt_tokens_total", "counter", "prompt tokens, cached ones included", m.prompt_tokens),
        ("prompt_cached_tokens_total", "counter", "prompt tokens reused from the KV cache", m.cached_tokens),
        ("generated_tokens_total", "counter", "tokens generated", m.generated_tokens),
        ("prompt_cache_entries", "gauge", "conversations kept for prompts that extend them", e.prompt_cache_entries),
        ("prompt_cache_bytes", "gauge", "bytes those conversations' KV cache takes", e.prompt_cache_bytes),
        ("busy_seconds_total", "counter", "time the engine spent in generation steps", m.busy_s),
        (
            "generated_tokens_per_busy_second",
            "gauge",
            "tokens generated by all requests per second of steps",
            m.generated_tokens / m.busy_s if m.busy_s else 0.0,
        ),
        (
            "disk_read_bytes_per_generated_token",
            "gauge",
            "expert bytes read from disk per token generated",
            e.bytes_read / m.generated_tokens if m.generated_tokens else 0.0,
        ),
        ("last_prompt_tokens_per_second", "gauge", "prompt speed of the last request", m.last_prompt_tps),
        ("last_decode_tokens_per_second", "gauge", "decode speed of the last request", m.last_decode_tps),
        ("expert_cache_hits_total", "counter", "routed experts found in the RAM cache", e.hits),
        ("expert_cache_misses_total", "counter", "routed experts read from disk", e.misses),
        ("expert_cache_hit_rate", "gauge", "hits / (hits + misses) since start", e.hit_rate),
        ("disk_read_bytes_total", "counter", "bytes of expert weights read from disk", e.bytes_read),
        ("expert_cache_slots_used", "gauge", "expert slots holding an expert", e.used_slots),
        ("expert_cache_slots", "gauge", "expert slots the RAM budget bought", e.n_slots),
        ("context_tokens", "gauge", "context length", e.ctx),
        ("resident_memory_bytes", "gauge", "resident set size of the server process", rss_bytes()),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [
            f"# HELP moestream_{name} {help_text}",
            f"# TYPE moestream_{name} {kind}",
            f"moestream_{name} {_num(value)}",
        ]
    lines += _histogram(
        "decode_batch_size", "rows (requests) per decode step", worker.batch.decode_batch_sizes, BATCH_SIZE_BUCKETS
    )
    return "\n".join(lines) + "\n"


def _histogram(name: str, help_text: str, counts: dict[int, int], buckets: tuple[int, ...]) -> list[str]:
    lines = [f"# HELP moestream_{name} {help_text}", f"# TYPE moestream_{name} histogram"]
    for le in buckets:
        lines.append(f'moestream_{name}_bucket{{le="{le}"}} {sum(n for v, n in counts.items() if v <= le)}')
    lines.append(f'moestream_{name}_bucket{{le="+Inf"}} {sum(counts.values())}')
    lines.append(f"moestream_{name}_sum {sum(v * n for v, n in counts.items())}")
    lines.append(f"moestream_{name}_count {sum(counts.values())}")
    return lines


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"
