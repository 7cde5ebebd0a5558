"""The browser front-end of `serve`: the chat page at `/`, the engine view at `/engine`, and the server-sent
events that feed the view, `/v1/engine/events` (documented in docs/engine-events.md).

The page is static files from the package (static/): no build step, nothing fetched from elsewhere; it talks to
the same OpenAI-compatible endpoints as any client. The events are built on the event loop, a few times a
second while someone listens, from reads of the engine's public state that take no lock the decode loop holds:
the expert cache's slot tables are copied in single C-level operations, the counters are plain integers.
They carry counts, ids and timings only, never a prompt's or an answer's text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse

from moestream.serving.schemas import APIError
from moestream.streaming.budget import rss_bytes

STATIC = Path(__file__).parent / "static"
PAGES = {"/": "index.html", "/engine": "index.html"}  # one page, two tabs: the path picks the first one shown
ASSETS = {"app.js": "text/javascript", "engine.js": "text/javascript", "style.css": "text/css"}
SNAPSHOT_S = 0.25  # four states a second: live to the eye, a small fraction of one core to build
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# the page may reach its own server only: a stray link or a script injected by an answer cannot call out
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# grid cells, one character per expert
NOT_CACHED, CACHED, PINNED, IN_FLIGHT, HIT = ".", "c", "p", "f", "h"


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_NAMES or host.startswith("127.")


class ExpertGrid:
    """The layers x experts picture of the expert cache: pinned (the profile part), cached (the LRU part),
    in flight (a fetch holds the slot: being read or computed with), recently hit (an LRU key refreshed since the
    last picture), not cached. Hits are found without touching the hot path: the LRU keeps the keys not used
    since the last picture in their old order, before every key used since, so the used ones are the tail from
    the first key out of that order (a hit on a key that was already last goes unseen)."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.n_layers = cache.store.n_layers
        self.n_experts = cache.store.n_experts
        self._order: dict[Any, int] = {}  # the LRU at the last picture: key -> position
        self.rows: list[str] = ["." * self.n_experts] * self.n_layers

    def picture(self) -> tuple[list[str], int]:
        """The grid (a string per layer) and how many LRU keys were refreshed since the last picture."""
        policy = self.cache.policy
        try:  # each a single copy under the GIL; a table changing between two of them skews one picture only
            order = list(policy.order)
            profile = list(policy.profile)
            key_of = list(policy.key_of)
            pins = list(policy.pins)
        except RuntimeError:  # a dict resized during a copy: keep the last picture
            return self.rows, 0
        hits = [k for k in touched_tail(self._order, order) if k in self._order]
        self._order = {k: i for i, k in enumerate(order)}
        rows = [bytearray(NOT_CACHED * self.n_experts, "ascii") for _ in range(self.n_layers)]
        marks = ((order, CACHED), (hits, HIT), (profile, PINNED))
        busy = [key_of[s] for s, n in enumerate(pins[: len(key_of)]) if n > 0 and key_of[s] is not None]
        for keys, mark in (*marks, (busy, IN_FLIGHT)):
            code = ord(mark)
            for key in keys:
                layer, expert = key
                if 0 <= layer < self.n_layers and 0 <= expert < self.n_experts:
                    rows[layer][expert] = code
        self.rows = [r.decode("ascii") for r in rows]
        return self.rows, len(hits)


def touched_tail(before: dict[Any, int], order: list[Any]) -> list[Any]:
    """The keys of `order` (oldest first) used since `before` was taken: from the first one that is new or out of
    `before`'s order to the end."""
    last = -1
    for i, key in enumerate(order):
        at = before.get(key)
        if at is None or at < last:
            return order[i:]
        last = at
    return []


class EngineEvents:
    """The engine's state as server-sent events: one `config` event, then a `state` event every SNAPSHOT_S for
    as long as the client listens. One sampler serves every listener, and runs only while there is one."""

    def __init__(self, engine: Any, worker: Any, model_name: str, period_s: float = SNAPSHOT_S):
        self.engine, self.worker, self.model_name, self.period_s = engine, worker, model_name, period_s
        self._grid: ExpertGrid | None = None  # made on first use: a scripted test engine has no cache
        self.listeners: set[asyncio.Queue[str]] = set()
        self._task: asyncio.Task[None] | None = None
        self._last: tuple[float, int, int, int, int, int] | None = None  # time and counters at the last state
        self.closing = False

    @property
    def grid(self) -> ExpertGrid:
        if self._grid is None:
            self._grid = ExpertGrid(self.engine.cache)
        return self._grid

    def config(self) -> dict[str, Any]:
        e, plan = self.engine, getattr(self.engine, "plan", None)
        budget = None
        if plan is not None:
            mib = 1 << 20
            parts = ("budget", "resident", "compute", "reader", "reserve")
            budget = {p + "_mib": round(getattr(plan, p) / mib, 1) for p in parts}
            budget["experts_mib"] = round(plan.n_slots * plan.slot_nbytes / mib, 1)
            budget["text"] = plan.describe()
        return {
            "model": self.model_name,
            "ctx": e.ctx,
            "max_batch": self.worker.batch.capacity,
            "layers": self.grid.n_layers,
            "experts": self.grid.n_experts,
            "n_slots": e.cache.n_slots,
            "slot_mib": round(e.cache.slot_nbytes / (1 << 20), 3),
            "budget": budget,
            "period_s": self.period_s,
        }

    def state(self) -> dict[str, Any]:
        """What changed since the last state: rates over the interval, the grid, the requests in the batch."""
        now, st, batch = time.perf_counter(), self.engine.cache.stats, self.worker.batch
        counters = (now, st.hits + st.pinned_hits, st.misses, st.bytes_read, batch.decode_tokens_run,
                    batch.prompt_tokens_run)  # fmt: skip
        last = self._last or counters
        self._last = counters
        dt = max(now - last[0], 1e-6)
        hits, misses = counters[1] - last[1], counters[2] - last[2]
        rows, refreshed = self.grid.picture()
        return {
            "t": round(time.time(), 3),
            "hit_rate": hits / (hits + misses) if hits + misses else None,  # over the interval; None: no access
            "hit_rate_total": st.hit_rate,
            "hits": st.hits + st.pinned_hits,
            "misses": st.misses,
            "disk_mb_s": round((counters[3] - last[3]) / dt / 1e6, 2),
            "decode_tps": round((counters[4] - last[4]) / dt, 2),
            "prefill_tps": round((counters[5] - last[5]) / dt, 2),
            "running": self.worker.running,
            "queued": self.worker.queued,
            "batch": batch.last_rows if counters[4:] != last[4:] else 0,  # rows of the last step, 0 when idle
            "requests": self.requests(),
            "slots_used": self.engine.cache.used_slots,
            "pinned": self.engine.cache.pinned_slots,
            "refreshed": refreshed,
            "rss_mib": round(rss_bytes() / (1 << 20), 1),
            "grid": rows,
        }

    def requests(self) -> list[dict[str, Any]]:
        """The requests holding a sequence slot: id and counts, no text."""
        try:
            active = list(self.worker.active.items())
        except RuntimeError:  # the worker added one during the copy
            return []
        out = []
        for seq, act in active:
            if act.index:  # a request's other choices share its row
                continue
            out.append({"id": act.job.request_id, "prompt_tokens": seq.stats.prompt_tokens,
                        "cached_tokens": seq.stats.reused_tokens, "generated": seq.stats.decode_tokens,
                        "phase": "prompt" if seq.prefilling else "decode"})  # fmt: skip
        return out

    async def stream(self) -> AsyncIterator[str]:
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=2)
        yield event("config", self.config())
        self.listeners.add(queue)
        if self._task is None:
            self._task = asyncio.create_task(self._sample())
        try:
            while not self.closing:  # the server stops: end the stream, or its shutdown would wait for it
                yield await queue.get()
        finally:
            self.listeners.discard(queue)
            if not self.listeners and self._task is not None:
                self._task.cancel()
                self._task, self._last = None, None

    async def _sample(self) -> None:
        build_ms = 0.0
        while True:
            t0 = time.perf_counter()
            body = self.state()
            body["build_ms"] = build_ms  # the previous state's: what the view costs the server's loop
            line = event("state", body)
            build_ms = round((time.perf_counter() - t0) * 1000, 3)
            for queue in list(self.listeners):
                if queue.full():  # a slow reader gets the newest state, not a backlog
                    queue.get_nowait()
                queue.put_nowait(line)
            await asyncio.sleep(self.period_s)


def event(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


def add_webui(app: FastAPI, engine: Any, worker: Any, model_name: str, *, page: bool, host: str) -> None:
    """/v1/engine/events always (scripts use it; the API key guards it with the rest of /v1); the page at / and
    /engine unless `page` is False (--no-webui). Bound to a loopback address, both answer only requests that
    name a loopback host, so a web page elsewhere cannot reach them by rebinding its own name to 127.0.0.1."""
    events = app.state.engine_events = EngineEvents(engine, worker, model_name)
    local = is_loopback(host)

    def check_host(request: Request) -> None:
        name = (request.url.hostname or "").lower()
        if local and name not in LOOPBACK_NAMES and not name.startswith("127."):
            raise APIError(403, f"this server listens on {host}; open it as http://127.0.0.1 or localhost",
                           code="forbidden_host")  # fmt: skip

    @app.get("/v1/engine/events")
    async def engine_events(request: Request) -> StreamingResponse:
        check_host(request)
        return StreamingResponse(events.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

    if not page:
        return

    async def index(request: Request) -> FileResponse:
        check_host(request)
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=SECURITY_HEADERS)

    for path in PAGES:
        app.get(path, include_in_schema=False)(index)

    @app.get("/static/{name}", include_in_schema=False)
    async def asset(name: str, request: Request) -> FileResponse:
        check_host(request)
        if name not in ASSETS:
            raise APIError(404, f"GET /static/{name} is not a file of the page", code="not_found")
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers=SECURITY_HEADERS)
