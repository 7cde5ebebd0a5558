"""The one thread that runs the engine for the HTTP server, its jobs and its metrics.

The worker runs one generation at a time and keeps the KV cache of the last conversation, so a follow-up
turn only computes its new tokens. Requests queue FIFO in front of it. Tokens travel from the worker to
the request's asyncio task through a thread-safe hand-off; a client that goes away sets the job's
`cancelled` flag, and the worker stops iterating the generation at its next token. Text is decoded and
cut at stop strings here (so a stop string ends generation at once).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from moestream.engine.sampling import Sampler
from moestream.errors import ContextError, DiskError
from moestream.serving.schemas import APIError
from moestream.serving.text import stream_text, usage_of
from moestream.streaming.budget import rss_bytes

FILE_CHECK_S = 5.0  # how often an idle server checks that its model file is unchanged


def _unavailable(reason: str) -> APIError:
    return APIError(503, f"the server cannot answer any more: {reason}", type="server_error")


@dataclass
class TextEvent:
    text: str


@dataclass
class DoneEvent:
    finish_reason: str  # stop | length | cancelled
    usage: dict[str, Any]


@dataclass
class ErrorEvent:
    error: APIError


Event = TextEvent | DoneEvent | ErrorEvent


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    keep_ids: frozenset[int] = frozenset()  # special tokens written as text (a chat format's markers)

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
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    last_prompt_tps: float = 0.0
    last_decode_tps: float = 0.0


class Worker:
    """The one thread that touches the engine. Jobs run in arrival order (FIFO is fair)."""

    def __init__(
        self, engine: Any, on_fatal: Callable[[str], None] | None = None, check_every_s: float = FILE_CHECK_S
    ):
        self.engine = engine
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.current: Job | None = None
        self.metrics = Metrics()
        self.fatal: str | None = None  # set when the model file changed: nothing more can be answered
        self.on_fatal = on_fatal
        self.check_every_s = check_every_s
        self.thread = threading.Thread(target=self._loop, name="moestream-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.fatal is not None:
            job.emit(ErrorEvent(_unavailable(self.fatal)))
            return
        self.jobs.put(job)

    def cancel_all(self) -> None:
        """Stop the running job and everything queued (the server is shutting down)."""
        with self.jobs.mutex:
            jobs = [*self.jobs.queue, self.current]
        for job in jobs:
            if job is not None:
                job.cancelled.set()

    def stop(self) -> None:
        self.cancel_all()
        self.jobs.put(None)  # after the cancelled jobs, each of which ends at once
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=self.check_every_s)
            except queue.Empty:  # idle: make sure the file is still the one whose weights are resident
                self._check_file()
                continue
            if job is None:
                return
            self.current = job
            try:
                if self.fatal is not None:
                    job.emit(ErrorEvent(_unavailable(self.fatal)))
                else:
                    self._run(job)
            finally:
                self.current = None

    def _check_file(self) -> bool:
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

    def _run(self, job: Job) -> None:
        m = self.metrics
        m.requests += 1
        if job.cancelled.is_set():  # the client left while queued
            m.cancelled += 1
            job.emit(DoneEvent("cancelled", {}))
            return
        last = None
        try:
            steps = stream_text(
                self.engine,
                job.prompt,
                job.max_tokens,
                job.sampler,
                stop_ids=self.engine.tokenizer.stop_ids,
                stop=job.stop,
                keep=job.keep_ids,
            )
            with closing(steps):
                for last in steps:
                    if last.text:
                        job.emit(TextEvent(last.text))
                    if job.cancelled.is_set():
                        break
        except Exception as exc:  # every failure must reach the client, not kill the worker
            m.failed += 1
            self.engine.reset()  # a forward pass that died half-way may have left the KV cache inconsistent
            if not self._check_file():
                job.emit(ErrorEvent(_unavailable(self.fatal or str(exc))))
                return
            # only a request that cannot fit is the client's fault; a model or disk failure is the server's
            status = 400 if isinstance(exc, ContextError) else 500
            kind = "invalid_request_error" if status == 400 else "server_error"
            job.emit(ErrorEvent(APIError(status, f"generation failed: {exc}", type=kind)))
            return
        assert last is not None  # the engine yields at least one token (max_tokens >= 1)
        st = last.stats
        reason = last.finish_reason or "cancelled"  # no finish reason: the loop stopped at a client gone
        if reason == "cancelled":
            m.cancelled += 1
        m.prompt_tokens += st.prompt_tokens
        m.cached_tokens += st.reused_tokens
        m.generated_tokens += st.decode_tokens
        m.last_prompt_tps, m.last_decode_tps = st.prompt_tps, st.decode_tps
        job.emit(DoneEvent(reason, usage_of(st)))


def metrics_text(worker: Worker) -> str:
    """Prometheus text exposition format."""
    m = worker.metrics
    e = worker.engine.snapshot()
    rows = [
        ("requests_total", "counter", "requests taken by the engine worker", m.requests),
        ("requests_cancelled_total", "counter", "requests stopped because the client went away", m.cancelled),
        ("requests_failed_total", "counter", "requests whose generation raised an error", m.failed),
        ("requests_queued", "gauge", "requests waiting for the engine", worker.jobs.qsize()),
        ("requests_running", "gauge", "requests generating now", int(worker.current is not None)),
        ("prompt_tokens_total", "counter", "prompt tokens, cached ones included", m.prompt_tokens),
        ("prompt_cached_tokens_total", "counter", "prompt tokens reused from the KV cache", m.cached_tokens),
        ("generated_tokens_total", "counter", "tokens generated", m.generated_tokens),
        ("prompt_cache_entries", "gauge", "conversations kept for prompts that extend them", e.prompt_cache_entries),
        ("prompt_cache_bytes", "gauge", "bytes those conversations' KV cache takes", e.prompt_cache_bytes),
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
    return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"
