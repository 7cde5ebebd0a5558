"""OpenAI-compatible HTTP server: the endpoints (requests -> engine jobs -> answers), the app and serve().

Each request's TextStream (stop strings, and for a chat its family's parser of thinking blocks and tool calls,
chat_formats) runs in the engine worker, which sends the answer's pieces as they come.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moestream.errors import MoestreamError
from moestream.serving.answer import Answer, Choice, new_id, sse
from moestream.serving.chat_formats import (
    HarmonyParser,
    OutputParser,
    chat_format,
    output_parser,
    render_prompt,
    starts_thinking,
    tool_system_prompt,
)
from moestream.serving.choices import APIKeyCheck, request_samplers, top_logprobs
from moestream.serving.schemas import (
    MAX_BODY_BYTES,
    MAX_STOP,
    APIError,
    ChatRequest,
    CompletionRequest,
    Message,
    Sampling,
    parse_body,
)
from moestream.serving.structured import request_grammar
from moestream.serving.text import TextStream, special_token_ids
from moestream.serving.webui import add_webui
from moestream.serving.worker import (
    Admission,
    DoneEvent,
    ErrorEvent,
    Event,
    Job,
    TextEvent,
    Worker,
    metrics_text,
)

DISCONNECT_POLL_S = 0.1
DEFAULT_MAX_TOKENS = 2048  # a request that gives no max_tokens generates at most this (and what fits)

# Variables render_chat sets itself (its parameters, the `documents` it passes, the helpers it installs):
# a request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({"template", "messages", "tools", "documents", "add_generation_prompt",
                                      "bos_token", "eos_token", "raise_exception", "strftime_now", "namespace",
                                      "dict"})  # fmt: skip


@dataclass
class Defaults:
    """Sampling settings for requests that do not give their own."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS


class Service:
    """The endpoints' logic: requests -> engine jobs -> OpenAI answers."""

    def __init__(
        self,
        engine: Any,
        model_name: str,
        defaults: Defaults,
        max_body_bytes: int,
        on_fatal: Callable[[str], None] | None = None,
        admission: Admission = Admission(),
    ):
        self.engine = engine
        self.tok = engine.tokenizer
        self.model_name = model_name
        self.defaults = defaults
        self.max_body_bytes = max_body_bytes
        self.worker = Worker(engine, on_fatal, admission=admission)
        self.created = int(time.time())
        self.format = chat_format(self.tok.chat_template)
        self._keep: dict[tuple[str, ...], frozenset[int]] = {}

    # -- endpoints ---------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Any:
        req = await parse_body(request, ChatRequest, self.max_body_bytes)
        self.check_model(req.model)
        prompt, parser = self.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = self.make_job(req, prompt, max_tokens, "messages", parser)
        job.grammars = [request_grammar(self.tok, self.format, req, parser) for _ in job.choices]
        return await self.answer(request, job, req, parser)

    async def completions(self, request: Request) -> Any:
        req = await parse_body(request, CompletionRequest, self.max_body_bytes)
        self.check_model(req.model)
        for name in ("echo", "suffix", "response_format"):
            if getattr(req, name):
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_value")
        if req.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of", code="unsupported_value")
        job = self.make_job(req, self.completion_prompt(req), req.max_tokens, "prompt")
        return await self.answer(request, job, req, None)

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        if name is not None:
            self.check_model(name)
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "moestream",
            "context_length": self.engine.ctx,
        }

    def health(self) -> dict[str, Any]:
        if not self.worker.thread.is_alive():
            raise APIError(503, "the engine worker is not running", type="server_error")
        return {"status": "ok", "model": self.model_name, "queued": self.worker.queued, "running": self.worker.running}

    # -- requests -> jobs --------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, os.path.basename(self.engine.model_path)):
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server runs '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def keep_ids(self, markers: tuple[str, ...]) -> frozenset[int]:
        """The special tokens among `markers`, written as text so that the output parser sees them."""
        if markers not in self._keep:
            self._keep[markers] = special_token_ids(self.tok, markers)
        return self._keep[markers]

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], OutputParser | HarmonyParser]:
        tok = self.tok
        if not tok.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if use_tools else None
        tool_prompt = tool_system_prompt(self.format, tok.chat_template, tools) if tools else None
        if use_tools and "tools" not in tok.chat_template and tool_prompt is None:
            raise APIError(400, "this model's chat template does not support tools", param="tools")
        extra = req.chat_template_kwargs or {}
        if req.reasoning_effort is not None:  # gpt-oss's template reads it; others ignore it
            extra = {"reasoning_effort": req.reasoning_effort, **extra}
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(extra))
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them itself",
                param="chat_template_kwargs",
                code="invalid_value",
            )
        messages = [message_dict(m, i) for i, m in enumerate(req.messages)]
        if tool_prompt is not None:
            messages = with_system_text(messages, tool_prompt)
        try:
            text, ids = render_prompt(tok, messages, tools=tools, **extra)
        except MoestreamError as exc:
            raise APIError(400, str(exc), param="messages") from None
        parser = output_parser(
            self.format, use_tools=use_tools, thinking=starts_thinking(self.format, text), tools=tools
        )
        return ids, parser

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(
                    400, "only one prompt per request is supported", param="prompt", code="unsupported_value"
                )
            p = p[0]
        if isinstance(p, str):
            return self.tok.encode(p)
        vocab = self.tok.vocab_size
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the {vocab}-token vocabulary",
                param="prompt",
                code="invalid_value",
            )
        return list(p)

    def make_job(
        self,
        req: Sampling,
        prompt: list[int],
        max_tokens: int | None,
        prompt_param: str,
        parser: OutputParser | HarmonyParser | None = None,
    ) -> Job:
        ctx = self.engine.ctx
        if len(prompt) >= ctx:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, your "
                f"{prompt_param} resulted in {len(prompt)} tokens. Please reduce the length of the "
                f"{prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if not prompt:
            raise APIError(400, f"the {prompt_param} is empty", param=prompt_param)
        if max_tokens is not None and not 1 <= max_tokens <= ctx:
            raise APIError(
                400,
                f"max_tokens must be between 1 and the context length ({ctx}), got {max_tokens}",
                param="max_tokens",
                code="invalid_value",
            )
        d = self.defaults
        samplers = request_samplers(req, d, self.worker.batch.capacity)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP:
            raise APIError(400, f"at most {MAX_STOP} stop strings are supported", param="stop", code="invalid_value")
        # max_tokens that fits the context but not after this prompt is cut to what fits (finish 'length')
        limit = min(d.max_tokens if max_tokens is None else max_tokens, ctx - len(prompt))
        keep = self.keep_ids(self.format.markers(parser.use_tools)) if parser is not None else frozenset()
        texts = [TextStream(self.tok, stop, keep, copy.deepcopy(parser) if i else parser) for i in range(len(samplers))]
        return Job(prompt, limit, samplers[0], texts[0], asyncio.get_running_loop(), top_logprobs=top_logprobs(req),
                   others=[*zip(samplers, texts, strict=True)][1:],
                   request_id=new_id(prompt_param == "messages"))  # fmt: skip

    # -- jobs -> answers ---------------------------------------------------------------------------

    async def run_job(self, job: Job, request: Request) -> AsyncIterator[Event]:
        """Queue the job and yield its events; leaving early (client gone, task cancelled) cancels it."""

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            job.cancelled.set()

        watcher = asyncio.create_task(watch())
        self.worker.submit(job)
        try:
            while True:
                event = await job.events.get()
                yield event
                if isinstance(event, ErrorEvent) or (isinstance(event, DoneEvent) and event.final):
                    return
        finally:
            job.cancelled.set()  # no-op once finished; otherwise stops the engine at its next token
            watcher.cancel()

    async def answer(
        self, request: Request, job: Job, req: Sampling, parser: OutputParser | HarmonyParser | None
    ) -> Any:
        """A chat answer (its job's TextStream has the parser), or a completion (parser None)."""
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        fmt = Answer(parser is not None, self.model_name, include_usage, request_id=job.request_id,
                     n=len(job.choices), tokenizer=self.tok if job.top_logprobs is not None else None)  # fmt: skip
        if req.stream:
            # the status line waits for the generation's first event: an error before the first token is
            # a proper 4xx/5xx answer, never a 200 with the error inside the stream
            events = self.run_job(job, request)
            try:
                first = await anext(events)
            except BaseException:
                await events.aclose()
                raise
            if isinstance(first, ErrorEvent):
                await events.aclose()
                raise first.error
            return StreamingResponse(
                self.stream(first, events, fmt),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        choices = [Choice() for _ in job.choices]
        async with aclosing(self.run_job(job, request)) as events:
            async for ev in events:
                if isinstance(ev, ErrorEvent):
                    raise ev.error
                c = choices[ev.index]
                if isinstance(ev, TextEvent):
                    c.pieces += ev.pieces
                    c.logprobs += ev.logprobs
                else:
                    c.finish_reason = ev.finish_reason
                    if ev.final:
                        return fmt.whole(choices, ev.usage, bool(parser and parser.use_tools))
        raise APIError(500, "generation ended without a result", type="server_error")

    async def stream(self, first: Event, events: AsyncIterator[Event], fmt: Answer) -> AsyncIterator[str]:
        """The SSE body of a generation whose first event (text or the end, not an error) is known."""

        async def all_events() -> AsyncIterator[Event]:
            yield first
            async for ev in events:
                yield ev

        for line in fmt.start():
            yield line
        async with aclosing(events), aclosing(all_events()) as evs:
            async for ev in evs:
                if isinstance(ev, ErrorEvent):
                    # a failure after the first token (a disk error mid-answer): the status line and part of
                    # the answer are sent already, so the error can only end the stream, as an error event
                    yield sse(ev.error.body())
                    break
                if isinstance(ev, DoneEvent) and ev.finish_reason == "cancelled":
                    return  # nobody is listening
                if isinstance(ev, TextEvent):
                    for line in fmt.pieces(ev.pieces, ev.index, ev.logprobs):
                        yield line
                else:
                    for line in fmt.end(ev.finish_reason, ev.usage if ev.final else None, ev.index):
                        yield line
        yield "data: [DONE]\n\n"


def create_app(
    engine: Any,
    model_name: str,
    *,
    defaults: Defaults | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    on_fatal: Callable[[str], None] | None = None,
    admission: Admission = Admission(),
    api_key: str | None = None,
    webui: bool = True,
    host: str = "127.0.0.1",
) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine worker and stops it (cancelling what is left).
    on_fatal(reason) is called from the worker when the server cannot answer any more (the model file
    changed under it). api_key: what every /v1 request's Authorization: Bearer must carry. webui: the page at /
    (webui.py; its events endpoint is there either way); host: the address the server listens on."""
    svc = Service(engine, model_name, defaults or Defaults(), max_body_bytes, on_fatal, admission)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        svc.worker.start()
        yield
        await asyncio.to_thread(svc.worker.stop)

    app = FastAPI(title="moestream", lifespan=lifespan)
    app.state.service = svc
    if api_key:
        app.add_middleware(APIKeyCheck, key=api_key)
    app.post("/v1/chat/completions")(svc.chat_completions)
    app.post("/v1/completions")(svc.completions)
    add_webui(app, engine, svc.worker, model_name, page=webui, host=host)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [svc.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        return svc.model_card(name)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return svc.health()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics_text(svc.worker), media_type="text/plain; version=0.0.4")

    # every error in OpenAI's shape, whatever raised it
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message, code = f"{request.method} {request.url.path} is not an endpoint here", "not_found"
        elif exc.status_code == 405:
            message, code = f"{request.url.path} does not take {request.method}", "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return APIError(exc.status_code, message, code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, f"invalid request: {exc.errors()}").response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    return app


def message_dict(m: Message, i: int) -> dict[str, Any]:
    """A request message as the chat template expects it: text content, tool-call arguments as dicts
    (HF templates iterate over them; Qwen3's also takes a string)."""
    d = m.model_dump(exclude_none=True)
    if d["role"] == "developer":  # OpenAI's newer name for the system role
        d["role"] = "system"
    if isinstance(m.content, list):
        if any(p.type != "text" for p in m.content):
            raise APIError(
                400, "only text content parts are supported", param=f"messages[{i}].content", code="unsupported_value"
            )
        d["content"] = "".join(p.text or "" for p in m.content)
    for call in d.get("tool_calls", []):
        fn = call["function"]
        if isinstance(fn["arguments"], str):
            try:
                parsed = json.loads(fn["arguments"] or "{}")
            except ValueError:
                continue  # leave it as text; the template writes it out as is
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
    return d


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` appended to the system message (a new first message where there is none)."""
    if messages and messages[0]["role"] == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def default_model_name(path: str) -> str:
    """The file's name without .gguf (a split model's without its -00001-of-0000N part number too)."""
    name = os.path.basename(os.path.normpath(path))
    return re.sub(r"(-\d{5}-of-\d{5})?\.gguf$", "", name, flags=re.IGNORECASE)


def serve(
    engine: Any,
    name: str,
    *,
    host: str,
    port: int,
    log_level: str,
    defaults: Defaults,
    admission: Admission = Admission(),
    sock: socket.socket | None = None,
    api_key: str | None = None,
    webui: bool = True,
) -> str | None:
    """Serve `engine` over HTTP until a signal ends it (the caller opens and closes the engine). Returns
    why the server stopped on its own (the model file changed), or None after a signal. `sock`: a socket
    already bound to host:port (the CLI binds before it loads the model), else uvicorn binds."""
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        if server is not None:
            server.should_exit = True

    app = create_app(engine, name, defaults=defaults, on_fatal=on_fatal, admission=admission, api_key=api_key,
                     webui=webui, host=host)  # fmt: skip
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    def on_signal(sig: int, frame: Any) -> None:
        # end the generations now (uvicorn waits for open connections); stop as uvicorn's handler does, but
        # without recording the signal it raises again once stopped, before the caller closes the engine
        app.state.service.worker.cancel_all()
        app.state.engine_events.closing = True
        server.force_exit, server.should_exit = server.should_exit and sig == signal.SIGINT, True

    server.handle_exit = on_signal  # type: ignore[method-assign]
    server.run(sockets=[sock] if sock is not None else None)
    return fatal[0] if fatal else None
