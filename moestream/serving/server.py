"""OpenAI-compatible HTTP server: `moestream serve -m MODEL.gguf`.

One worker thread owns the engine (it runs one generation at a time and keeps the KV cache of the last
conversation, so a follow-up turn only computes its new tokens). Requests queue FIFO in front of it.
Tokens travel from the worker to the request's asyncio task through a thread-safe hand-off; a client that
goes away sets the job's `cancelled` flag, which the engine's on_token callback returns to stop.

Text is decoded and cut at stop strings in the worker (so a stop string ends generation at once); tool
calls (Qwen3/Hermes `<tool_call>{json}</tool_call>` blocks) are parsed on the asyncio side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moestream.engine.sampling import Sampler
from moestream.errors import MoestreamError
from moestream.formats.chat_template import render_chat
from moestream.streaming.budget import rss_bytes

MAX_BODY_BYTES = 32 << 20  # a request bigger than this is refused (413) before it is parsed
DISCONNECT_POLL_S = 0.1

# --------------------------------------------------------------------------------------------------
# Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}
# --------------------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# --------------------------------------------------------------------------------------------------
# Request bodies. Strict: "0.5" is not a number (OpenAI refuses it too). Unknown fields are ignored,
# since clients send many we have no use for (user, metadata, ...).
# --------------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's, but llama.cpp's and vLLM's servers take it
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} (vLLM's name)
    logprobs: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None


B = TypeVar("B", bound=_Body)


async def parse_body(request: Request, model: type[B], max_bytes: int) -> B:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param_name(err["loc"])
        raise APIError(
            400,
            f"invalid value for '{param}': {err['msg']}",
            param=param,
            code="invalid_type" if err["type"] != "missing" else "missing_required_parameter",
        ) from None


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {max_bytes >> 20} MB", code="request_too_large")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}  # names pydantic gives union members


def _param_name(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; stops at union member tags like 'list[str]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or "body"


# --------------------------------------------------------------------------------------------------
# Text pipeline: stop strings (worker side) and tool calls (asyncio side)
# --------------------------------------------------------------------------------------------------


def _partial_suffix(text: str, needles: list[str]) -> int:
    """Length of the longest end of `text` that is the start of some needle (it may still become one)."""
    best = 0
    for s in needles:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopText:
    """Token ids -> text increments, cut before the first stop string; text that might be the start of a
    stop string is held back until it is known not to be."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.decoder = tokenizer.stream(skip_special=True)
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        return self._push(self.decoder.add(token_id))

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self._push(self.decoder.flush())
        if not self.stopped:
            out, self.pending = out + self.pending, ""
        return out

    def _push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = _partial_suffix(self.pending, self.stop)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, with_index: bool = False) -> dict[str, Any]:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, **d} if with_index else d


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


class ToolCallParser:
    """Splits streamed text into content and Qwen3/Hermes `<tool_call>\\n{json}\\n</tool_call>` calls.

    feed() returns what can be sent now: content strings and whole ToolCalls. Text that might be the
    start of `<tool_call>` is held back, and so is trailing whitespace (it is dropped if a call follows).
    A block whose JSON does not parse is passed on as content, as written.
    """

    def __init__(self) -> None:
        self.buf = ""
        self.space = ""  # whitespace held back
        self.in_call = False
        self.space_before = ""  # whitespace before the open call: layout if it parses, content if not
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buf += text
        out: list[str | ToolCall] = []
        while True:
            if not self.in_call:
                i = self.buf.find(TOOL_OPEN)
                if i < 0:
                    cut = len(self.buf) - _partial_suffix(self.buf, [TOOL_OPEN])
                    self._content(self.buf[:cut], out)
                    self.buf = self.buf[cut:]
                    return out
                self._content(self.buf[:i], out)
                self.space_before, self.space = self.space, ""
                self.buf, self.in_call = self.buf[i + len(TOOL_OPEN) :], True
            else:
                i = self.buf.find(TOOL_CLOSE)
                if i < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:i], self.buf[i + len(TOOL_CLOSE) :], False
                call = self._parse(body)
                if call is None:
                    self._content(self.space_before + TOOL_OPEN + body + TOOL_CLOSE, out)
                else:
                    self.calls.append(call)
                    out.append(call)

    def finish(self) -> list[str | ToolCall]:
        """At the end of generation: whatever is held back (an unfinished call is content)."""
        out: list[str | ToolCall] = []
        rest = (self.space_before + TOOL_OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        self._content(rest, out)
        if self.space and not self.calls:
            out.append(self.space)
        self.space = ""
        return out

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if body:
            out.append(body)

    def _parse(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return ToolCall(len(self.calls), obj["name"], args)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole-text version of ToolCallParser: (content or None, calls)."""
    p = ToolCallParser()
    pieces = p.feed(text) + p.finish()
    content = "".join(x for x in pieces if isinstance(x, str))
    return content or None, p.calls


# --------------------------------------------------------------------------------------------------
# The engine worker
# --------------------------------------------------------------------------------------------------


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

    def __init__(self, engine: Any):
        self.engine = engine
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.current: Job | None = None
        self.metrics = Metrics()
        self.thread = threading.Thread(target=self._loop, name="moestream-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
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
        while (job := self.jobs.get()) is not None:
            self.current = job
            try:
                self._run(job)
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        m = self.metrics
        m.requests += 1
        if job.cancelled.is_set():  # the client left while queued
            m.cancelled += 1
            job.emit(DoneEvent("cancelled", {}))
            return
        tok = self.engine.tokenizer
        stop_ids = tok.stop_ids
        text = StopText(tok, job.stop)

        def on_token(t: int) -> bool:
            if t not in stop_ids:
                piece = text.add(t)
                if piece:
                    job.emit(TextEvent(piece))
                if text.stopped:
                    return True
            return job.cancelled.is_set()

        try:
            gen = self.engine.generate(job.prompt, job.max_tokens, job.sampler, stop_ids, on_token)
        except Exception as exc:  # every failure must reach the client, not kill the worker
            m.failed += 1
            self.engine.reset()  # a forward pass that died half-way may have left the KV cache inconsistent
            status = 400 if isinstance(exc, MoestreamError) else 500
            kind = "invalid_request_error" if status == 400 else "server_error"
            job.emit(ErrorEvent(APIError(status, f"generation failed: {exc}", type=kind)))
            return
        st = gen.stats
        tail = text.flush() if not job.cancelled.is_set() else ""
        if tail:
            job.emit(TextEvent(tail))
        if text.stopped:
            reason = "stop"
        elif job.cancelled.is_set():
            reason = "cancelled"
            m.cancelled += 1
        else:
            reason = st.finish_reason
        m.prompt_tokens += st.prompt_tokens
        m.cached_tokens += st.reused_tokens
        m.generated_tokens += len(gen.tokens)
        m.last_prompt_tps, m.last_decode_tps = st.prompt_tps, st.decode_tps
        job.emit(DoneEvent(reason, _usage(st.prompt_tokens, len(gen.tokens), st.reused_tokens)))


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def metrics_text(worker: Worker) -> str:
    """Prometheus text exposition format."""
    e, m = worker.engine, worker.metrics
    cs = e.cache.stats
    rows = [
        ("requests_total", "counter", "requests taken by the engine worker", m.requests),
        ("requests_cancelled_total", "counter", "requests stopped because the client went away", m.cancelled),
        ("requests_failed_total", "counter", "requests whose generation raised an error", m.failed),
        ("requests_queued", "gauge", "requests waiting for the engine", worker.jobs.qsize()),
        ("requests_running", "gauge", "requests generating now", int(worker.current is not None)),
        ("prompt_tokens_total", "counter", "prompt tokens, cached ones included", m.prompt_tokens),
        ("prompt_cached_tokens_total", "counter", "prompt tokens reused from the KV cache", m.cached_tokens),
        ("generated_tokens_total", "counter", "tokens generated", m.generated_tokens),
        ("last_prompt_tokens_per_second", "gauge", "prompt speed of the last request", m.last_prompt_tps),
        ("last_decode_tokens_per_second", "gauge", "decode speed of the last request", m.last_decode_tps),
        ("expert_cache_hits_total", "counter", "routed experts found in the RAM cache", cs.hits),
        ("expert_cache_misses_total", "counter", "routed experts read from disk", cs.misses),
        ("expert_cache_hit_rate", "gauge", "hits / (hits + misses) since start", cs.hit_rate),
        ("disk_read_bytes_total", "counter", "bytes of expert weights read from disk", cs.bytes_read),
        ("expert_cache_slots_used", "gauge", "expert slots holding an expert", e.cache.used_slots),
        ("expert_cache_slots", "gauge", "expert slots the RAM budget bought", e.cache.n_slots),
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


# --------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------


@dataclass
class Defaults:
    """Sampling settings for requests that do not give their own."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


class Answer:
    """Formats one request's answer: OpenAI's chat or text-completion objects, whole or as SSE chunks."""

    def __init__(self, chat: bool, model_name: str, include_usage: bool = False):
        self.chat = chat
        self.include_usage = include_usage
        self.base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

    def _chunk(self, choice: dict[str, Any] | None, usage: Any = None) -> str:
        body: dict[str, Any] = {**self.base, "choices": [] if choice is None else [choice]}
        if self.include_usage or usage is not None:  # with include_usage, every chunk has the key
            body["usage"] = usage
        return _sse(body)

    def _choice(self, piece: str | ToolCall | None, finish: str | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        if piece is None:
            delta: dict[str, Any] = {}
        elif isinstance(piece, str):
            delta = {"content": piece}
        else:
            delta = {"tool_calls": [piece.to_dict(with_index=True)]}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def start(self) -> list[str]:
        return (
            [
                self._chunk(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            ]
            if self.chat
            else []
        )

    def piece(self, piece: str | ToolCall) -> str:
        return self._chunk(self._choice(piece))

    def end(self, finish: str, usage: dict[str, Any]) -> list[str]:
        # usage rides on the last chunk; with include_usage, in a chunk of its own as OpenAI sends it
        if not self.include_usage:
            return [self._chunk(self._choice(None, finish), usage)]
        return [self._chunk(self._choice(None, finish)), self._chunk(None, usage)]

    def whole(self, text: str, done: DoneEvent, use_tools: bool) -> dict[str, Any]:
        if not self.chat:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
            return {**self.base, "choices": [choice], "usage": done.usage}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls: list[ToolCall] = []
        if use_tools:
            message["content"], calls = parse_tool_calls(text)
            if calls:
                message["tool_calls"] = [c.to_dict() for c in calls]
        finish = _finish(done.finish_reason, bool(calls))
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return {**self.base, "object": "chat.completion", "choices": [choice], "usage": done.usage}


class Service:
    """The endpoints' logic: requests -> engine jobs -> OpenAI answers."""

    def __init__(self, engine: Any, model_name: str, defaults: Defaults, max_body_bytes: int):
        self.engine = engine
        self.tok = engine.tokenizer
        self.model_name = model_name
        self.defaults = defaults
        self.max_body_bytes = max_body_bytes
        self.worker = Worker(engine)
        self.created = int(time.time())

    # -- endpoints ---------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Any:
        req = await parse_body(request, ChatRequest, self.max_body_bytes)
        self.check_model(req.model)
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
        prompt, use_tools = self.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = self.make_job(req, prompt, max_tokens, "messages")
        return await self.answer(request, job, req, chat=True, use_tools=use_tools)

    async def completions(self, request: Request) -> Any:
        req = await parse_body(request, CompletionRequest, self.max_body_bytes)
        self.check_model(req.model)
        for name in ("echo", "suffix", "logprobs"):
            if getattr(req, name):
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_value")
        if req.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of", code="unsupported_value")
        job = self.make_job(req, self.completion_prompt(req), req.max_tokens, "prompt")
        return await self.answer(request, job, req, chat=False, use_tools=False)

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
        return {"status": "ok", "model": self.model_name, "queued": self.worker.jobs.qsize()}

    # -- requests -> jobs --------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, os.path.basename(self.engine.gguf.path)):
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server runs '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], bool]:
        tok = self.tok
        if not tok.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        use_tools = bool(req.tools) and req.tool_choice != "none"
        if use_tools and "tools" not in tok.chat_template:
            raise APIError(400, "this model's chat template does not support tools", param="tools")
        messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if use_tools else None
        try:
            text = render_chat(
                tok.chat_template,
                messages,
                tools=tools,
                bos_token=tok.bos_token,
                eos_token=tok.eos_token,
                **(req.chat_template_kwargs or {}),
            )
        except MoestreamError as exc:
            raise APIError(400, str(exc), param="messages") from None
        # a template that writes the BOS token itself must not get a second one
        add_bos = False if tok.bos_token and text.startswith(tok.bos_token) else None
        return tok.encode(text, add_bos=add_bos), use_tools

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

    def make_job(self, req: _Sampling, prompt: list[int], max_tokens: int | None, prompt_param: str) -> Job:
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
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
        try:
            sampler = Sampler(
                temperature=d.temperature if req.temperature is None else req.temperature,
                top_k=d.top_k if req.top_k is None else req.top_k,
                top_p=d.top_p if req.top_p is None else req.top_p,
                seed=d.seed if req.seed is None else req.seed,
            )
        except ValueError as exc:
            param = next((p for p in ("temperature", "top_k", "top_p") if p in str(exc)), None)
            raise APIError(400, str(exc), param=param, code="invalid_value") from None
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        # max_tokens that fits the context but not after this prompt is cut to what fits (finish 'length')
        limit = ctx - len(prompt) if max_tokens is None else max_tokens
        return Job(prompt, limit, sampler, stop, asyncio.get_running_loop())

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
                if not isinstance(event, TextEvent):
                    return
        finally:
            job.cancelled.set()  # no-op once finished; otherwise stops the engine at its next token
            watcher.cancel()

    async def answer(self, request: Request, job: Job, req: _Sampling, *, chat: bool, use_tools: bool) -> Any:
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        fmt = Answer(chat, self.model_name, include_usage)
        if req.stream:
            return StreamingResponse(
                self.stream(request, job, fmt, ToolCallParser() if use_tools else None),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        parts: list[str] = []
        async with aclosing(self.run_job(job, request)) as events:
            async for ev in events:
                if isinstance(ev, TextEvent):
                    parts.append(ev.text)
                elif isinstance(ev, ErrorEvent):
                    raise ev.error
                else:
                    return fmt.whole("".join(parts), ev, use_tools)
        raise APIError(500, "generation ended without a result", type="server_error")

    async def stream(
        self, request: Request, job: Job, fmt: Answer, parser: ToolCallParser | None
    ) -> AsyncIterator[str]:
        for line in fmt.start():
            yield line
        async with aclosing(self.run_job(job, request)) as events:
            async for ev in events:
                if isinstance(ev, ErrorEvent):  # the status line is sent already: the error goes in the stream
                    yield _sse(ev.error.body())
                    break
                if isinstance(ev, DoneEvent) and ev.finish_reason == "cancelled":
                    return  # nobody is listening
                if isinstance(ev, TextEvent):
                    pieces = parser.feed(ev.text) if parser else [ev.text]
                else:
                    pieces = parser.finish() if parser else []
                for piece in pieces:
                    yield fmt.piece(piece)
                if isinstance(ev, DoneEvent):
                    for line in fmt.end(_finish(ev.finish_reason, bool(parser and parser.calls)), ev.usage):
                        yield line
        yield "data: [DONE]\n\n"


def create_app(
    engine: Any, model_name: str, *, defaults: Defaults | None = None, max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine worker and stops it (cancelling what is left)."""
    svc = Service(engine, model_name, defaults or Defaults(), max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        svc.worker.start()
        yield
        await asyncio.to_thread(svc.worker.stop)

    app = FastAPI(title="moestream", lifespan=lifespan)
    app.state.service = svc
    app.post("/v1/chat/completions")(svc.chat_completions)
    app.post("/v1/completions")(svc.completions)

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


def _message_dict(m: Message, i: int) -> dict[str, Any]:
    """A request message as the chat template expects it: text content, tool-call arguments as dicts
    (HF templates iterate over them; Qwen3's also takes a string)."""
    d = m.model_dump(exclude_none=True)
    if d["role"] == "developer":  # OpenAI's newer name for the system role
        d["role"] = "system"
    if isinstance(m.content, list):
        if any(p.type != "text" for p in m.content):
            raise APIError(
                400,
                "only text content parts are supported",
                param=f"messages[{i}].content",
                code="unsupported_value",
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


def _finish(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def default_model_name(path: str) -> str:
    return re.sub(r"\.gguf$", "", os.path.basename(path), flags=re.IGNORECASE)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from moestream.cli.main import open_engine

    if not 0 <= args.port < 65536:
        raise MoestreamError(f"--port must be between 0 and 65535, got {args.port}")
    engine = open_engine(args)
    try:
        name = args.model_name or default_model_name(args.model)
        defaults = Defaults(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        app = create_app(engine, name, defaults=defaults)
        if engine.plan is not None:
            print(engine.plan.describe(), flush=True)
        print(
            f"moestream: serving {name} on http://{args.host}:{args.port}/v1 (context {engine.ctx} tokens, "
            f"{engine.cache.n_slots} expert slots)",
            flush=True,
        )
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
        )
        server = uvicorn.Server(config)
        handle_exit = server.handle_exit

        def on_signal(sig: int, frame: Any) -> None:
            # uvicorn waits for open connections before it shuts down, and a streaming answer can run
            # for minutes: end the generations now (their streams close without [DONE])
            app.state.service.worker.cancel_all()
            handle_exit(sig, frame)

        server.handle_exit = on_signal  # type: ignore[method-assign]
        server.run()
    finally:
        engine.close()
    return 0


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    """`moestream serve` and `moestream chat`."""
    from moestream.cli.main import _add_engine_args
    from moestream.serving.chat import add_chat_command

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    _add_engine_args(p)
    # defaults for requests that leave them out; 1.0 is OpenAI's default temperature
    p.add_argument("--temp", type=float, default=1.0, help="default temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="default top-k (default 0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="default top-p (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="default seed (default: random)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--model-name", default=None, help="model id clients use (default: the file name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=serve)
    add_chat_command(sub)
