"""A request's sampling, as the engine takes it: its n choices' samplers, the log-probabilities it asks for, and
the API key every /v1 request must carry when the server has one."""

from __future__ import annotations

import hmac
from typing import Any

from moestream.engine.sampling import SEED_MAX, Sampler
from moestream.serving.schemas import APIError, ChatRequest, CompletionRequest, Sampling

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs (its completions take 5)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed")  # fmt: skip


def request_samplers(req: Sampling, defaults: Any, max_n: int) -> list[Sampler]:
    """One sampler per choice: the request's settings (the server's defaults where it gives none); choice i
    seeded with seed + i when a seed is given. n above the sequences that run at once is refused."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise APIError(
            400,
            f"n must be between 1 and {max_n} (the requests this server runs at once, --max-batch), got {n}",
            param="n",
            code="invalid_value",
        )
    d = defaults

    def pick(name: str, default: Any) -> Any:
        value = getattr(req, name, None)
        return default if value is None else value

    try:
        first = Sampler(
            temperature=pick("temperature", d.temperature),
            top_k=pick("top_k", d.top_k),
            top_p=pick("top_p", d.top_p),
            seed=pick("seed", d.seed),
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
        )
    except ValueError as exc:
        param = next((p for p in SAMPLING_FIELDS if str(exc).startswith(p)), None)
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    seed = first.seed
    return [first, *(first.with_seed(None if seed is None else (seed + i) % (SEED_MAX + 1)) for i in range(1, n))]


def top_logprobs(req: Sampling) -> int | None:
    """How many of the most likely tokens to report beside each token (None: no log-probabilities)."""
    if isinstance(req, CompletionRequest):  # the legacy field: the count itself
        top, param = req.logprobs, "logprobs"
    else:
        assert isinstance(req, ChatRequest)
        top, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param=param, code="invalid_value")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", param=param,
                       code="invalid_value")  # fmt: skip
    return top


class APIKeyCheck:
    """ASGI middleware: a /v1 request without `Authorization: Bearer KEY` gets 401 in OpenAI's shape. The key is
    compared in constant time and never written anywhere."""

    def __init__(self, app: Any, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")) and not self.allowed(scope):
            error = APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def allowed(self, scope: dict[str, Any]) -> bool:
        header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        scheme, _, given = header.partition(b" ")
        # compare_digest takes as long whatever the bytes are, so the time leaks no prefix of the key
        return hmac.compare_digest(given.strip(), self.key) and scheme.lower() == b"bearer"
