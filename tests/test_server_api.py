"""The server's sampling API (issue 45): n choices, log-probabilities, penalties, the API key and the request log.

Against the real `python -m moestream serve` on a tiny random-weight model, driven with the official `openai`
client; the engine-level test checks that n choices prefill their prompt once and decode in shared steps.
"""

from __future__ import annotations

import http.client
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.synth.shapes import write_synth
from tests.test_server import MODEL, _assert_error, _chat, serve_process

KEY = "sk-test-7f3a9c"
SECRET_PROMPT = "zebra quartz lantern"  # must never reach the log


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", progress=False)


@pytest.fixture(scope="module")
def served(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The server (4 sequences at once, an API key, request lines logged) and its log file."""
    log_dir = tmp_path_factory.mktemp("server_api")
    args = ["--ram-budget-mb", "2000", "--max-batch", "4", "--batch-window-ms", "0", "--api-key", KEY]
    with serve_process(model_path, log_dir, *args, "--log-level", "info") as url:
        yield url, log_dir / "server.log"


@pytest.fixture(scope="module")
def client(served: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(url: str, path: str, body: Any, key: str | None = KEY) -> tuple[int, dict[str, Any]]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


# ----------------------------------------------------------------------------------------- n choices


def test_n_choices(served: tuple[str, Path], client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=_chat("Tell me about caches."), max_tokens=8)
    greedy = client.chat.completions.create(n=3, temperature=0, logprobs=True, **kw)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    # the prompt counted once, every choice's tokens (an end token has no logprobs entry)
    made = sum(len(c.logprobs.content) + (c.finish_reason == "stop") for c in greedy.choices)
    assert greedy.usage.completion_tokens == made
    assert greedy.usage.prompt_tokens == client.chat.completions.create(**{**kw, "max_tokens": 1}).usage.prompt_tokens
    sampled = client.chat.completions.create(n=3, temperature=1.0, seed=41, **kw)
    texts = [c.message.content for c in sampled.choices]
    assert texts == [
        c.message.content for c in client.chat.completions.create(n=3, temperature=1.0, seed=41, **kw).choices
    ]
    assert len(set(texts)) > 1  # seeds 41, 42, 43
    # choice i is seeded with seed + i: the same text as a request of its own with that seed
    alone = client.chat.completions.create(temperature=1.0, seed=42, **kw)
    assert alone.choices[0].message.content == texts[1]
    # streamed: every chunk names its choice, and each choice's text is the one sent whole
    streamed: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in client.chat.completions.create(n=3, temperature=1.0, seed=41, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == texts and sorted(finished) == [0, 1, 2]
    _assert_error(*_post(served[0], "/v1/chat/completions", {**kw, "n": 5}), 400, param="n")  # over --max-batch 4


def test_n_prefills_once_and_decodes_together(model_path: str) -> None:
    engine = Engine(model_path, EngineOptions(n_slots=10_000, ctx=256, max_batch=4))
    try:
        prompt = engine.tokenizer.encode("Experts live on disk and")
        alone = engine.generate(prompt, 6).tokens
        engine.reset()
        rows: list[tuple[int, bool]] = []
        step = engine.step

        def spy(blocks: list[list[int]], *args: Any, **kw: Any) -> Any:
            rows.append((sum(len(b) for b in blocks), len(blocks)))
            return step(blocks, *args, **kw)

        engine.step = spy  # type: ignore[method-assign]
        batch = engine.scheduler()
        seqs = batch.add_choices(prompt, 6, [Sampler(), Sampler(), Sampler(1.0, seed=3)])
        out: dict[int, list[int]] = {}
        while len(batch):
            for ev in batch.step():
                out.setdefault(id(ev.sequence), []).append(ev.token)
    finally:
        engine.close()
    assert out[id(seqs[0])] == out[id(seqs[1])] == alone
    assert rows[0] == (len(prompt), 1)  # the prompt ran once, for the three of them
    assert all(r == (3, 3) for r in rows[1:])  # then every step decoded the three together


# ----------------------------------------------------------------------------------- log-probabilities


def test_chat_logprobs(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=_chat("What is a cache?"), max_tokens=10, temperature=0)
    r = client.chat.completions.create(logprobs=True, top_logprobs=5, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    for e in content:
        top = e.top_logprobs
        assert len(top) == 5 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert sum(math.exp(t.logprob) for t in top) <= 1 + 1e-6
        assert (e.token, e.logprob) == (top[0].token, top[0].logprob)  # greedy: the most likely token
    streamed = []
    for chunk in client.chat.completions.create(logprobs=True, top_logprobs=5, stream=True, **kw):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs and c.logprobs.content else []
    # the second request resumes from the live cache, so its last prompt token runs alone where the first ran
    # it in the prompt's span: the tokens are the same, the float32 logits only within rounding
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert client.chat.completions.create(**kw).choices[0].logprobs is None


def test_completion_logprobs_legacy_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The expert network", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == logprob and top[tok] == logprob
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_sampled_frequencies_match_logprobs(client: openai.OpenAI) -> None:
    """The first token drawn from one prompt over many seeds: each candidate's frequency is near exp(logprob),
    the log-probability of the tempered distribution the server reports."""
    draws: Counter[str] = Counter()
    reported: dict[str, float] = {}
    for seed in range(0, 120, 4):
        r = client.completions.create(model=MODEL, prompt="The expert network", max_tokens=1, temperature=0.5,
                                      logprobs=5, n=4, seed=seed)  # fmt: skip
        for c in r.choices:
            draws[c.logprobs.tokens[0]] += 1
            reported.update(c.logprobs.top_logprobs[0])
    n = sum(draws.values())
    for tok, logprob in reported.items():
        p = math.exp(logprob)
        assert abs(draws[tok] / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 0.03, (tok, draws[tok], n, p)
    assert sum(draws[t] for t in reported) >= 0.5 * n  # the top five hold most of the draws: the test has teeth


def test_bad_logprob_and_penalty_values(served: tuple[str, Path]) -> None:
    url, chat = served[0], {"model": MODEL, "messages": _chat("hi"), "max_tokens": 1}
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("min_p", 1.5), ("top_logprobs", 3), ("n", 0)]:  # fmt: skip
        _assert_error(*_post(url, "/v1/chat/completions", {**chat, field: value}), 400, param=field)
    _assert_error(*_post(url, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}), 400)
    _assert_error(*_post(url, "/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 21}), 400)


# ------------------------------------------------------------------------------------------ penalties


def test_frequency_penalty_stops_a_repeating_greedy_token(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="the the the the the", max_tokens=24, temperature=0, logprobs=0)
    plain = client.completions.create(**kw).choices[0].logprobs.tokens
    assert Counter(plain).most_common(1)[0][1] >= 3  # the tiny model repeats itself here
    penalized = client.completions.create(frequency_penalty=2.0, **kw).choices[0].logprobs.tokens
    assert penalized != plain and Counter(penalized).most_common(1)[0][1] < Counter(plain).most_common(1)[0][1]
    presence = client.completions.create(presence_penalty=2.0, **kw).choices[0].logprobs.tokens
    assert presence != plain


# ------------------------------------------------------------------------------------ key and the log


def test_api_key(served: tuple[str, Path]) -> None:
    url = served[0]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    for key in (None, "wrong", KEY + "x"):
        status, err = _post(url, "/v1/completions", body, key)
        _assert_error(status, err, 401, code="invalid_api_key")
        assert KEY not in json.dumps(err)
    assert _post(url, "/v1/completions", body)[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).models.list().data[0].id == MODEL


def test_one_log_line_per_request(served: tuple[str, Path], client: openai.OpenAI) -> None:
    ids = [client.chat.completions.create(model=MODEL, messages=_chat(SECRET_PROMPT), max_tokens=3, n=2).id,
           client.completions.create(model=MODEL, prompt=SECRET_PROMPT, max_tokens=2, temperature=0).id]  # fmt: skip
    chunks = client.chat.completions.create(model=MODEL, messages=_chat(SECRET_PROMPT), max_tokens=2, stream=True)
    ids.append(next(iter(chunks)).id)
    list(chunks)
    log = served[1].read_text()
    for rid in ids:
        lines = [line for line in log.splitlines() if f"request {rid}:" in line]
        assert len(lines) == 1, (rid, lines)
        assert all(w in lines[0] for w in ("prompt", "cached", "generated", "first token", "tok/s", "finish"))
    assert SECRET_PROMPT not in log and KEY not in log
