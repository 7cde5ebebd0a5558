"""What the HTTP server accepts: request bodies (pydantic, strict) and errors in OpenAI's shape."""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect

MAX_BODY_BYTES = 32 << 20  # a request bigger than this is refused (413) before it is parsed
MAX_DEPTH = 64  # JSON nested deeper than this is refused (400) before it is parsed
MAX_STOP = 16  # stop strings per request (OpenAI takes 4)

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
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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


class Sampling(_Body):
    """What every generating request takes. The penalties are OpenAI's (presence_penalty, frequency_penalty:
    -2..2, over the generated tokens) and llama.cpp's / HF's (repetition_penalty > 0, 1 = off, over the prompt
    and the generated tokens); min_p (0..1) keeps the tokens at least that fraction as likely as the most likely
    one. n choices (at most --max-batch) share the prompt's prefill and every decode step; given a seed, choice
    i is seeded with seed + i.

    Log-probabilities (chat: logprobs + top_logprobs 0..20; completions: logprobs 0..20) are those of the
    distribution the token is drawn from before the cuts: softmax((logits after the penalties) / temperature),
    temperature 1 for greedy requests (whose token is then always the most likely). top_k / top_p / min_p
    renormalize what they keep; the numbers reported do not."""

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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # llama.cpp's and vLLM's servers take it
    min_p: float | None = None  # llama.cpp's and vLLM's servers take it


class ChatRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} (vLLM's name)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # OpenAI's; gpt-oss's template reads it
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None
    response_format: Any = None  # not OpenAI's on completions: refused, never silently ignored


B = TypeVar("B", bound=_Body)


async def parse_body(request: Request, model: type[B], max_bytes: int) -> B:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the request body ended before its Content-Length", code="invalid_json") from None
    raw = b"".join(chunks)
    if json_depth(raw) > MAX_DEPTH:
        raise APIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json")
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


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN = np.frombuffer(b"[{", np.uint8)
_CLOSE = np.frombuffer(b"]}", np.uint8)


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, counted on the bytes (brackets inside strings
    do not count), so that a hostile body never reaches a recursive parser."""
    if b"[" not in raw and b"{" not in raw:
        return 0
    code = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
    step = np.isin(code, _OPEN).astype(np.int32) - np.isin(code, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


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
