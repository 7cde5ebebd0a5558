"""serve-ray on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint.

Two deployments. `EngineReplica`: one moestream engine (its own budget and threads) and `serve`'s own app
(serving/app.py: the same routes, streaming, tools, errors, web page), which it runs in-process on each
request forwarded to it, sending back the ASGI messages as a stream. `Ingress`: the HTTP side (Ray Serve's
proxy sends it every request): it reads the body, computes the request's prefix keys (prefix_router.py) and
hands the request to the replicas through a handle whose router sends it to the replica holding its
conversation, else to the least loaded; it answers /metrics itself (every replica's, labelled, and their sum,
replica_metrics.py) and /health (how many replicas report).

A replica that dies (a crash, the OOM killer, `ray.kill`) is replaced by Ray Serve. Its requests end at once
with a retryable error: 503 with Retry-After in OpenAI's error shape when no answer was sent yet, else (a
stream under way) an SSE error event in that shape, as `serve` ends a stream that fails; the next requests go
to the live replicas.

`serve run` takes the application too, through `moestream.cli.serve_ray:build` (docs/ray.md).
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from moestream.distributed.prefix_router import DEFAULT_IMBALANCE, ROUTE_KWARG, PrefixAffinityRouter, prefix_keys
from moestream.distributed.replica_metrics import BOARD_NAME, REPORT_S, MetricsBoard, combined_text
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.serving.answer import sse
from moestream.serving.app import Defaults, create_app
from moestream.serving.schemas import MAX_BODY_BYTES, APIError
from moestream.serving.worker import Admission, metrics_text

APP_NAME = "moestream"
NAMESPACE = "moestream"  # where the metrics board lives
RETRY_AFTER_S = 1
REPLICA_HEADER = "x-moestream-replica"  # which replica answered (its Ray Serve replica id)
DISCONNECT_POLL_S = 0.1
# a request still waiting for its answer to begin asks the metrics board this often whether any replica runs,
# and is answered 503 once none has for NO_REPLICA_S (Ray Serve would keep it queued for a replacement that
# may never start: a node gone, a budget no node has left)
BOARD_POLL_S = 2.0
NO_REPLICA_S = 30.0
# what of the HTTP request's ASGI scope travels to the replica, which runs serve's app on it
SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers", "server",
              "client")  # fmt: skip


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica opens and serves: its engine's options (its own budget and threads) and serve's app's."""

    model: str  # an absolute path: every machine has the file there
    engine: EngineOptions
    name: str  # the model id clients use
    defaults: Defaults
    admission: Admission
    api_key: str | None
    webui: bool
    host: str


@dataclass
class Settings:
    """What the application is built from (the serve-ray command line, checked)."""

    spec: ReplicaSpec
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    threads: int = 1  # per replica: its engine's threads and the CPUs Ray reserves for it
    memory_bytes: int = 0  # per replica: what Ray reserves of a node's memory (its budget)
    max_ongoing: int = 8  # requests Ray Serve sends one replica at once
    imbalance: int = DEFAULT_IMBALANCE
    app_name: str = APP_NAME

    @property
    def board(self) -> str:
        return f"{BOARD_NAME}-{self.app_name}"


def board_actor(name: str) -> Any:
    """The application's metrics board (created by whoever asks first; detached: it outlives replicas)."""
    cls = ray.remote(num_cpus=0)(MetricsBoard)
    return cls.options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()


async def next_message(out: asyncio.Queue, task: asyncio.Task) -> dict | None:
    """The app's next ASGI message, those it sent before returning included; None once it returned and all
    were taken (its exception, if it raised one, is raised here)."""
    while out.empty() and not task.done():
        get = asyncio.ensure_future(out.get())
        await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
    if not out.empty():
        return out.get_nowait()
    if task.exception() is not None:
        raise task.exception()
    return None


class EngineReplica:
    """One engine and serve's app on it (Ray Serve deployment body)."""

    async def __init__(self, spec: ReplicaSpec, board: str):
        self.engine = Engine(spec.model, spec.engine)
        self.app = create_app(self.engine, spec.name, defaults=spec.defaults, admission=spec.admission,
                              api_key=spec.api_key, webui=spec.webui, host=spec.host)  # fmt: skip
        self._life = self.app.router.lifespan_context(self.app)
        await self._life.__aenter__()
        self.worker = self.app.state.service.worker
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.board = board_actor(board)
        self._report = asyncio.create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.replica, metrics_text(self.worker))
            except ray.exceptions.RayError:  # the board went away (the application is being deleted)
                pass
            await asyncio.sleep(REPORT_S)

    def check_health(self) -> None:
        if not self.worker.thread.is_alive():
            raise RuntimeError("the engine worker is not running")

    async def call(self, scope: dict[str, Any], body: bytes, route: list[str] | None = None) -> AsyncIterator[dict]:
        """Run serve's app on one request; yield its response: {status, headers} first, then body chunks."""
        out: asyncio.Queue[dict] = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await out.put(message)

        task = asyncio.create_task(self.app({**scope, "app": self.app}, receive, send))
        try:
            while True:
                msg = await next_message(out, task)
                if msg is None:  # the app returned without finishing its response
                    return
                if msg["type"] == "http.response.start":
                    headers = [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])]
                    headers.append((REPLICA_HEADER.encode(), self.replica.encode()))
                    yield {"status": msg["status"], "headers": headers}
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield {"body": bytes(msg["body"])}
                    if not msg.get("more_body", False):
                        return
        finally:
            gone.set()  # a client that left: the app's disconnect watch cancels the generation
            if not task.done():
                try:
                    await asyncio.wait_for(task, timeout=5)
                except (asyncio.TimeoutError, Exception):
                    task.cancel()

    async def __del__(self) -> None:
        if not hasattr(self, "_report"):  # __init__ failed before the engine was up: nothing to close
            return
        self._report.cancel()
        try:
            await self.board.drop.remote(self.replica)
        except Exception:  # the board is gone already
            pass
        await self._life.__aexit__(None, None, None)
        self.engine.close()


# a replica lost before or while it answers: Ray's errors for a dead or unreachable actor, and Serve's
LOST = (ray.exceptions.RayError, serve.exceptions.RayServeException)


def replica_lost(exc: BaseException) -> APIError:
    return APIError(
        503,
        f"the replica serving this request was lost ({type(exc).__name__}); Ray Serve replaces it, retry the request",
        type="server_error",
        code="replica_lost",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def no_replica() -> APIError:
    return APIError(
        503,
        f"no engine replica has run for {NO_REPLICA_S:.0f} s (one that died is not back yet); retry the request later",
        type="server_error",
        code="no_replica",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class NoReplica(Exception):
    """No replica reported for NO_REPLICA_S while a request waited for its answer to begin."""


# ingress's helpers come before its class: serve.ingress pickles the app (its routes and what they use) at once
async def read_body(request: Request) -> bytes | Response:
    """The body, or the 413 `serve` answers for one too large (this side must not hold it either)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                            code="request_too_large").response()  # fmt: skip
        chunks.append(chunk)
    return b"".join(chunks)


def route_keys(request: Request, body: bytes) -> list[str]:
    if request.method != "POST" or not body:
        return []
    try:
        return prefix_keys(request.url.path, json.loads(body))
    except (ValueError, RecursionError):  # not JSON: the replica answers it with serve's error
        return []


async def first_message(gen: Any, request: Request, board: Any) -> dict | None:
    """The response's start, or None if the client leaves first (the request is then cancelled); NoReplica when
    no replica has reported to the board for NO_REPLICA_S meanwhile."""
    nxt = asyncio.ensure_future(gen.__anext__())
    polled, silent_since = time.monotonic(), None
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=DISCONNECT_POLL_S)
            if done:
                return nxt.result()
            if await request.is_disconnected():
                gen.cancel()
                return None
            now = time.monotonic()
            if now - polled >= BOARD_POLL_S:
                polled = now
                silent_since = None if await board.fresh.remote() else (silent_since or now)
                if silent_since is not None and now - silent_since >= NO_REPLICA_S:
                    gen.cancel()
                    raise NoReplica
    except StopAsyncIteration:
        raise ray.exceptions.RayError("the replica ended the response before it began") from None
    finally:
        if not nxt.done():
            nxt.cancel()


async def rest(gen: Any, stream: bool) -> AsyncIterator[bytes]:
    """The body after the start; a replica lost mid-stream ends an SSE stream with an error event."""
    finished = False
    try:
        async for msg in gen:
            yield msg["body"]
        finished = True
    except LOST as exc:
        if stream:
            yield sse(replica_lost(exc).body()).encode()
            yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client left: stop the replica's generation
            gen.cancel()


api = FastAPI(title="moestream serve-ray")


@serve.ingress(api)
class Ingress:
    """The HTTP side (Ray Serve deployment body)."""

    def __init__(self, engine: DeploymentHandle, board: str):
        self.engine = engine.options(stream=True)
        self.board = board_actor(board)

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        texts = await self.board.fresh.remote()
        return PlainTextResponse(combined_text(texts), media_type="text/plain; version=0.0.4")

    @api.get("/health")
    async def health(self) -> JSONResponse:
        texts = await self.board.fresh.remote()
        if not texts:
            return APIError(503, "no engine replica is running yet", type="server_error",
                            headers={"Retry-After": str(RETRY_AFTER_S)}).response()  # fmt: skip
        return JSONResponse({"status": "ok", "replicas": len(texts)})

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(self, request: Request, path: str) -> Response:
        body = await read_body(request)
        if isinstance(body, Response):
            return body
        keys = route_keys(request, body)
        scope = {k: request.scope[k] for k in SCOPE_KEYS if k in request.scope}
        scope["root_path"] = ""
        gen = self.engine.call.remote(scope, body, **{ROUTE_KWARG: keys})
        try:
            first = await first_message(gen, request, self.board)
        except LOST as exc:
            return replica_lost(exc).response()
        except NoReplica:
            return no_replica().response()
        if first is None:  # the client left before the answer began
            return Response(status_code=499)
        stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in first["headers"])
        response = StreamingResponse(rest(gen, stream), status_code=first["status"])
        response.raw_headers = first["headers"]
        return response


def build_app(settings: Settings) -> Any:
    """The Ray Serve application (what serve.run takes)."""
    replica_opts: dict[str, Any] = {
        "ray_actor_options": {
            "num_cpus": settings.threads,
            **({"memory": settings.memory_bytes} if settings.memory_bytes else {}),
        },
        "max_ongoing_requests": settings.max_ongoing,
        "request_router_config": RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"imbalance": settings.imbalance}
        ),
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 10,
    }
    if settings.min_replicas is not None or settings.max_replicas is not None:
        replica_opts["autoscaling_config"] = {
            "min_replicas": settings.min_replicas if settings.min_replicas is not None else 1,
            "max_replicas": settings.max_replicas if settings.max_replicas is not None else settings.replicas,
            "initial_replicas": settings.replicas,
            "target_ongoing_requests": max(1, settings.max_ongoing // 2),
        }
    else:
        replica_opts["num_replicas"] = settings.replicas
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(**replica_opts)
    ingress = serve.deployment(Ingress, name="Ingress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000
    )
    return ingress.bind(engine.bind(settings.spec, settings.board), settings.board)
