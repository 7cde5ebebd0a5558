"""The OpenAI-compatible server, driven with the official `openai` client over loopback.

Most tests run against the real `python -m moestream serve` on a tiny random-weight model. A random model
never writes a tool call, so the tool-call tests also run an in-process server whose engine "generates"
a scripted text, and the parsers are tested directly on crafted text.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import uvicorn

from moestream.engine.prompt_cache import Conversation
from moestream.engine.scheduler import Sequence, TokenEvent
from moestream.engine.stats import EngineSnapshot, GenerationStats, GenerationStep
from moestream.formats.chat_template import render_chat
from moestream.formats.gguf_file import GGUFFile
from moestream.formats.tokenizer import Tokenizer
from moestream.serving.app import create_app, message_dict
from moestream.serving.chat_formats import QWEN, output_parser
from moestream.serving.schemas import Message
from moestream.serving.text import TextDelta, TextStream, ToolCall, ToolCallParser, parse_tool_calls
from moestream.synth.shapes import write_synth

CTX = 2048
MODEL = "tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_path: str) -> Tokenizer:
    f = GGUFFile(model_path)
    try:
        return Tokenizer.from_metadata(f.metadata)
    finally:
        f.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(model_path: str, log_dir: Any, *args: str) -> Iterator[str]:
    """`moestream serve` on the model in a child process until the block ends; yields its URL."""
    port = _free_port()
    log = open(log_dir / "server.log", "w+")  # closed below
    cmd = [sys.executable, "-m", "moestream", "serve", "-m", model_path, "--ctx", str(CTX), "--port", str(port),
           "--model-name", MODEL, "--log-level", "warning", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read()}")
            try:
                if _get(url, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server did not come up in time")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_process(model_path, tmp_path_factory.mktemp("server"), "--ram-budget-mb", "2000") as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


# ------------------------------------------------------------------------------------------- helpers


def _request(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read()
    finally:
        conn.close()


def _get(url: str, path: str) -> tuple[int, str, bytes]:
    return _request(url, "GET", path)


def _post(url: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, data = _request(url, "POST", path, raw)
    return status, json.loads(data)


def _assert_error(status: int, body: dict[str, Any], want: int, param: Any = ..., code: Any = ...) -> None:
    assert status == want, body
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err


def _metrics(url: str) -> dict[str, float]:
    status, ctype, data = _get(url, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    out = {}
    for line in data.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            out[name] = float(value)
    return out


def _chat(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _stream_chat(client: openai.OpenAI, **kw: Any) -> tuple[str, str | None, Any]:
    text, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, usage


def _stream_completion(client: openai.OpenAI, **kw: Any) -> str:
    return "".join(c.choices[0].text for c in client.completions.create(model=MODEL, stream=True, **kw) if c.choices)


# ------------------------------------------------------------------------------- the real server


def test_models_health(server: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = _get(server, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=_chat("What is the weather like?"), max_tokens=8, temperature=0
    )
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason == "length"
    u = r.usage
    assert u.completion_tokens == 8 and u.total_tokens == u.prompt_tokens + 8

    # a follow-up turn extends the conversation: its shared prefix comes from the KV cache
    history = [
        *_chat("What is the weather like?"),
        {"role": "assistant", "content": c.message.content},
        *_chat("And tomorrow?"),
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=history, max_completion_tokens=4, temperature=0)
    assert r2.usage.completion_tokens == 4
    assert r2.usage.prompt_tokens_details.cached_tokens >= u.prompt_tokens


def test_chat_stream_matches(client: openai.OpenAI) -> None:
    kw = dict(messages=_chat("Tell me about the cache."), max_tokens=10, temperature=0)
    whole = client.chat.completions.create(model=MODEL, **kw)
    text, finish, usage = _stream_chat(client, stream_options={"include_usage": True}, **kw)
    assert text == whole.choices[0].message.content
    assert finish == "length"
    assert usage.completion_tokens == 10 and usage.prompt_tokens == whole.usage.prompt_tokens
    # without include_usage the usage still rides on the last chunk
    assert _stream_chat(client, **kw)[2].completion_tokens == 10


def test_completion(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    r = client.completions.create(model=MODEL, prompt="The expert network", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    text = r.choices[0].text
    assert _stream_completion(client, prompt="The expert network", max_tokens=6, temperature=0) == text
    ids = tokenizer.encode("The expert network")  # a prompt of token ids
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r2.choices[0].text == text and r2.usage.prompt_tokens == len(ids)


def test_stop_strings(client: openai.OpenAI) -> None:
    kw = dict(prompt="The cache keeps", max_tokens=24, temperature=0)
    full = client.completions.create(model=MODEL, **kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = full[: full.find(stop)]
    r = client.completions.create(model=MODEL, stop=stop, **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    assert _stream_completion(client, stop=[stop, "\x00never"], **kw) == cut


def test_seed_repeats(client: openai.OpenAI) -> None:
    kw = dict(messages=_chat("Good morning!"), max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    a = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    b = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    assert a == b


def test_tool_round_trip(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # the server rendered exactly what the template makes of tools, the call and its result
    text = render_chat(
        tokenizer.chat_template,
        [message_dict(Message.model_validate_json(json.dumps(m)), i) for i, m in enumerate(messages)],
        tools=TOOLS,
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tools>" in text and '<tool_response>\n{"temperature": 21}' in text
    assert r.usage.prompt_tokens == len(tokenizer.encode(text))
    # tool_choice "none": the tools stay out of the prompt
    r2 = client.chat.completions.create(
        model=MODEL, messages=messages[:2], tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0
    )
    plain = render_chat(tokenizer.chat_template, messages[:2])
    assert r2.usage.prompt_tokens == len(tokenizer.encode(plain))


def test_metrics(server: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    m = _metrics(server)
    assert m["moestream_generated_tokens_total"] >= 3
    assert m["moestream_prompt_tokens_total"] > 0
    assert m["moestream_last_decode_tokens_per_second"] > 0
    assert 0 < m["moestream_expert_cache_hit_rate"] <= 1
    assert m["moestream_disk_read_bytes_total"] > 0
    assert 0 < m["moestream_expert_cache_slots_used"] <= m["moestream_expert_cache_slots"]
    assert m["moestream_resident_memory_bytes"] > 50 << 20
    assert m["moestream_context_tokens"] == CTX


# ------------------------------------------------------------------------------------------- errors


def test_malformed_requests(server: str) -> None:
    ok = {"model": MODEL, "messages": _chat("hi"), "max_tokens": 1}
    _assert_error(*_post(server, "/v1/chat/completions", b'{"model": "tiny", "messages": ['), 400, code="invalid_json")
    _assert_error(*_post(server, "/v1/chat/completions", b"\xff\xfe"), 400, code="invalid_json")
    _assert_error(*_post(server, "/v1/chat/completions", [1, 2]), 400)
    _assert_error(*_post(server, "/v1/chat/completions", {**ok, "temperature": "hot"}), 400, param="temperature")
    _assert_error(*_post(server, "/v1/chat/completions", {**ok, "max_tokens": "10"}), 400, param="max_tokens")
    _assert_error(*_post(server, "/v1/chat/completions", {**ok, "messages": "hi"}), 400, param="messages")
    _assert_error(
        *_post(server, "/v1/chat/completions", {**ok, "messages": [{"role": "robot", "content": "x"}]}),
        400,
        param="messages[0].role",
    )
    _assert_error(*_post(server, "/v1/chat/completions", {**ok, "stop": 3}), 400, param="stop")
    _assert_error(*_post(server, "/v1/chat/completions", {"model": MODEL}), 400, param="messages")
    _assert_error(*_post(server, "/v1/chat/completions", {**ok, "messages": []}), 400, param="messages")
    _assert_error(*_post(server, "/v1/chat/completions", {**ok, "n": 65}), 400, param="n")  # over --max-batch
    _assert_error(*_post(server, "/v1/chat/completions", {**ok, "top_p": 0.0}), 400, param="top_p")
    _assert_error(*_post(server, "/v1/completions", {"model": MODEL, "prompt": 7}), 400, param="prompt")
    _assert_error(*_post(server, "/v1/completions", {"model": MODEL, "prompt": [10**9]}), 400, param="prompt")
    status, _, body = _request(server, "GET", "/v1/nothing")
    _assert_error(status, json.loads(body), 404)
    status, _, body = _request(server, "GET", "/v1/chat/completions")
    _assert_error(status, json.loads(body), 405)


def test_unknown_model(server: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=_chat("hi"), max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    _assert_error(*_post(server, "/v1/completions", {"model": "nope", "prompt": "a"}), 404, code="model_not_found")
    status, _, body = _get(server, "/v1/models/nope")
    _assert_error(status, json.loads(body), 404)


def test_context_limits(server: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_chat("hi"), max_tokens=CTX + 1)
    assert e.value.param == "max_tokens"
    _assert_error(
        *_post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}),
        400,
        param="max_tokens",
    )
    long = "the expert " * CTX
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=_chat(long), max_tokens=1, stream=stream)
        assert e.value.code == "context_length_exceeded" and e.value.status_code == 400
    _assert_error(
        *_post(server, "/v1/completions", {"model": MODEL, "prompt": long}),
        400,
        param="prompt",
        code="context_length_exceeded",
    )
    # max_tokens that fits the context alone but not after the prompt is cut to what fits
    r = client.completions.create(
        model=MODEL, prompt="the expert " * (CTX // 2 - 4), max_tokens=CTX - 8, temperature=0, stream=False
    )
    assert r.usage.total_tokens <= CTX and r.choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------- concurrency


def test_concurrent_streams_match_alone(client: openai.OpenAI) -> None:
    a = dict(prompt="Could you please summarize", max_tokens=32, temperature=0)
    b = dict(messages=_chat("Write code."), max_tokens=32, temperature=0.8, seed=7)
    alone = (_stream_completion(client, **a), _stream_chat(client, **b)[0])
    assert alone[0] != alone[1]

    results: dict[str, str] = {}
    spans: dict[str, tuple[float, float]] = {}
    go = threading.Barrier(2)

    def run(name: str) -> None:
        go.wait()
        t0 = time.monotonic()
        results[name] = _stream_completion(client, **a) if name == "a" else _stream_chat(client, **b)[0]
        spans[name] = (t0, time.monotonic())

    threads = [threading.Thread(target=run, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert max(s for s, _ in spans.values()) < min(e for _, e in spans.values())  # they did overlap
    assert (results["a"], results["b"]) == alone


def _open_stream(server: str, path: str, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, Any]:
    u = urlsplit(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def _read_events(r: Any, n: int) -> None:
    events = 0
    while events < n:
        line = r.fp.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data: ")


def _hang_up(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def _wait_cancelled(server: str, before: float) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m["moestream_requests_cancelled_total"] > before and m["moestream_requests_running"] == 0:
            return m
        time.sleep(0.05)
    pytest.fail("the server kept generating for a client that went away")


def test_disconnect_stops_generation(server: str, client: openai.OpenAI) -> None:
    m0 = _metrics(server)
    budget = CTX - 64  # seconds of tokens if nothing stopped them
    u = urlsplit(server)

    # streaming: read a few events, then hang up
    conn, r = _open_stream(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "The user asks", "max_tokens": budget, "temperature": 0},
    )
    _read_events(r, 3)
    _hang_up(conn)
    m1 = _wait_cancelled(server, m0["moestream_requests_cancelled_total"])
    assert m1["moestream_generated_tokens_total"] - m0["moestream_generated_tokens_total"] < budget // 2

    # non-streaming: the client gives up waiting
    body = {"model": MODEL, "messages": _chat("Tell me everything."), "max_tokens": budget, "temperature": 0}
    with socket.create_connection((u.hostname, u.port)) as s:
        data = json.dumps(body).encode()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        time.sleep(0.5)
    m2 = _wait_cancelled(server, m1["moestream_requests_cancelled_total"])
    assert m2["moestream_generated_tokens_total"] - m1["moestream_generated_tokens_total"] < budget // 2

    # and the engine is fine afterwards
    r2 = client.chat.completions.create(model=MODEL, messages=_chat("Hello"), max_tokens=3, temperature=0)
    assert r2.usage.completion_tokens == 3


def test_disconnect_while_queued(server: str, client: openai.OpenAI) -> None:
    m0 = _metrics(server)
    budget = CTX - 64
    running, r = _open_stream(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "When the cache", "max_tokens": budget, "temperature": 0},
    )
    _read_events(r, 1)  # generating
    # a queued stream gets its status line only when the engine starts it: send it without waiting for one
    u = urlsplit(server)
    queued = socket.create_connection((u.hostname, u.port))
    data = json.dumps(
        {"model": MODEL, "messages": _chat("Me next"), "max_tokens": budget, "temperature": 0, "stream": True}
    ).encode()
    queued.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    deadline = time.monotonic() + 30
    while _metrics(server)["moestream_requests_queued"] != 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.02)
    queued.shutdown(socket.SHUT_RDWR)
    queued.close()
    time.sleep(0.3)  # let the server notice before the engine frees up
    _hang_up(running)
    m1 = _wait_cancelled(server, m0["moestream_requests_cancelled_total"] + 1)
    assert m1["moestream_requests_queued"] == 0
    assert m1["moestream_generated_tokens_total"] - m0["moestream_generated_tokens_total"] < budget // 2
    r2 = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r2.usage.completion_tokens == 2


# ------------------------------------------------------------------------------ tool-call parsing


CALLS_TEXT = (
    "Let me check the weather.\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_parse_tool_calls() -> None:
    content, calls = parse_tool_calls(CALLS_TEXT)
    assert content == "Let me check the weather."
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris", "unit": "celsius"}),
        (1, "get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    assert (
        parse_tool_calls("<tool_call>\n" + '{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>')[1][0].arguments
        == '{"a": 1}'
    )
    # no calls: the text comes back exactly, whitespace and all
    assert parse_tool_calls("  a < b <tool\n\n") == ("  a < b <tool\n\n", [])
    # a block that is not a call stays content; an unfinished one too
    bad = "x <tool_call>\nnot json\n</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])
    assert parse_tool_calls('y <tool_call>\n{"name": "f"') == ('y <tool_call>\n{"name": "f"', [])


@pytest.mark.parametrize("seed", range(8))
def test_streaming_tool_parser_matches_whole(seed: int) -> None:
    rng = random.Random(seed)
    for text in (CALLS_TEXT, "plain text, no calls <tool", "a <tool_call>\nnot json\n</tool_call> b  ", ""):
        p = ToolCallParser()
        pieces: list[Any] = []
        i = 0
        while i < len(text):
            n = rng.randint(1, 6) if seed else 1  # seed 0: one character at a time
            pieces += p.feed(text[i : i + n])
            i += n
        pieces += p.finish()
        content, calls = parse_tool_calls(text)
        assert "".join(x for x in pieces if isinstance(x, str)) == (content or "")
        streamed = [x for x in pieces if not isinstance(x, str)]
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
        # nothing that could still become "<tool_call>" was sent as content before the call showed up
        assert all("<tool" not in x for x in pieces if isinstance(x, str)) or not calls


def _deltas(text: TextStream, ids: list[int], reason: str | None = "length") -> list[TextDelta]:
    """Feed a generation's tokens, the last with `reason`, until the stream ends."""
    out = []
    for i, t in enumerate(ids):
        out.append(text.add(t, reason if i == len(ids) - 1 else None))
        if text.finish_reason is not None:
            break
    return out


def test_text_stream_holds_back_partial_stops(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The cache is full, so the expert is dropped.")
    st = TextStream(tokenizer, ["is dropped", "zzz"])
    deltas = _deltas(st, ids)
    assert "".join(d.text for d in deltas) == "The cache is full, so the expert " and st.stopped
    assert st.finish_reason == "stop" and len(deltas) < len(ids)  # nothing after the stop string is taken
    assert [d.pieces for d in deltas] == [[d.text] if d.text else [] for d in deltas]
    st = TextStream(tokenizer, ["zzz"])
    assert "".join(d.text for d in _deltas(st, ids)) == tokenizer.decode(ids) and st.finish_reason == "length"


def test_text_stream_splits_tool_calls(tokenizer: Tokenizer) -> None:
    """With a chat format's parser the answer comes as pieces, and a stop after calls finishes as tool_calls."""
    ids = [*tokenizer.encode(CALLS_TEXT), tokenizer.eos_id]
    st = TextStream(tokenizer, parser=output_parser(QWEN, use_tools=True, tools=TOOLS))
    deltas = _deltas(st, ids, "stop")
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids[:-1])
    pieces = [p for d in deltas for p in d.pieces]
    assert "".join(p for p in pieces if isinstance(p, str)) == "Let me check the weather."
    assert [p.name for p in pieces if isinstance(p, ToolCall)] == ["get_weather", "get_time"]
    assert st.finish_reason == "tool_calls" and st.add(ids[0]).pieces == [] and st.cancel() == []
    # a generation that stops early: what the parser held back comes out, the finish is "cancelled"
    st = TextStream(tokenizer, parser=output_parser(QWEN, use_tools=True, tools=TOOLS))
    cut = tokenizer.encode("Let me check <tool")
    assert "".join(p for d in _deltas(st, cut, None) for p in d.pieces if isinstance(p, str)) == "Let me check"
    assert st.cancel() == [" <tool"] and st.finish_reason == "cancelled"


# ------------------------------------------------------------ tool calls through a scripted server


class ScriptedEngine:
    """Stands in for Engine: every answer is `script`, token by token (a random model never calls tools)."""

    def __init__(self, tokenizer: Tokenizer, script: str, ctx: int = 512):
        self.tokenizer = tokenizer
        self.script = script
        self.ctx = ctx
        self.model_path = "/models/scripted.gguf"

    def check_model_file(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(model_path=self.model_path, ctx=self.ctx, n_slots=8)

    def stream(
        self, prompt: list[int], max_new_tokens: int, sampler: Any, stop_ids: set[int]
    ) -> Iterator[GenerationStep]:
        """The terminal chat's way in (serve goes through scheduler())."""
        st = GenerationStats(prompt_tokens=len(prompt))
        for i, t in enumerate(itertools.islice(self.tokens(prompt), max_new_tokens)):
            st.decode_tokens = i + 1
            reason = "stop" if t in stop_ids else "length" if i + 1 == max_new_tokens else None
            if reason is not None:
                st.finish_reason = reason
            yield GenerationStep(t, st, reason)
            if reason is not None:
                return

    def scheduler(self) -> ScriptedBatch:
        return ScriptedBatch(self)

    def tokens(self, prompt: list[int]) -> Iterator[int]:
        """What the engine 'generates' for a prompt."""
        yield from [*self.tokenizer.encode(self.script), self.tokenizer.eos_id]


class ScriptedBatch:
    """Stands in for engine.scheduler.Scheduler: each sequence generates its engine's tokens, all in the same steps."""

    def __init__(self, engine: ScriptedEngine):
        self.engine = engine
        self.running: list[Sequence] = []
        self.capacity = 4
        self.decode_batch_sizes: Counter[int] = Counter()
        self.script: dict[Sequence, Iterator[int]] = {}

    def __len__(self) -> int:
        return len(self.running)

    def add(self, prompt: list[int], max_new_tokens: int, sampler: Any, stop_ids: set[int]) -> Sequence:
        seq = Sequence(prompt, max_new_tokens, sampler, stop_ids, conversation=Conversation(None))
        seq.stats.prompt_tokens = len(prompt)
        self.running.append(seq)
        self.script[seq] = self.engine.tokens(prompt)
        return seq

    def add_choices(
        self, prompt: list[int], max_new_tokens: int, samplers: list[Any], stop_ids: set[int], top_logprobs: Any = None
    ) -> list[Sequence]:
        return [self.add(prompt, max_new_tokens, sampler, stop_ids) for sampler in samplers]

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        self.running.remove(seq)
        seq.finish_reason = seq.stats.finish_reason = reason

    def fail_running(self) -> list[Sequence]:
        failed, self.running = self.running, []
        return failed

    def step(self) -> list[TokenEvent]:
        events = []
        for seq in list(self.running):
            t = next(self.script[seq])
            seq.n_new = seq.stats.decode_tokens = seq.n_new + 1
            reason = "stop" if t in seq.stop_ids else "length" if seq.n_new >= seq.max_new_tokens else None
            if reason is not None:
                self.cancel(seq, reason)
            events.append(TokenEvent(seq, t, reason))
        return events


@contextmanager
def _running(app: Any) -> Iterator[str]:
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert t.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=30)


@pytest.fixture(scope="module")
def scripted(tokenizer: Tokenizer) -> Iterator[str]:
    app = create_app(ScriptedEngine(tokenizer, CALLS_TEXT), "scripted", max_body_bytes=4096)
    with _running(app) as url:
        yield url


def test_tool_calls_scripted(scripted: str) -> None:
    c = openai.OpenAI(base_url=scripted + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="scripted", messages=_chat("Weather in Paris?"), tools=TOOLS)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check the weather."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {}),
    ]
    assert all(t.type == "function" and t.id.startswith("call_") for t in ch.message.tool_calls)

    content, finish, calls = "", None, {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for d in chunk.choices:
            content += d.delta.content or ""
            finish = d.finish_reason or finish
            for tc in d.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and content == "Let me check the weather."
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {}),
    ]

    # without tools in the request the text is passed through as written
    r = c.chat.completions.create(model="scripted", messages=_chat("hi"))
    assert r.choices[0].message.content == CALLS_TEXT and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls


class FailingEngine(ScriptedEngine):
    def tokens(self, prompt: list[int]) -> Iterator[int]:
        if self.tokenizer.encode("crash")[0] in prompt:
            raise RuntimeError("the model file is unreadable")
        if self.tokenizer.encode("boom")[0] in prompt:
            yield self.tokenizer.encode("partial")[0]
            raise RuntimeError("the disk went away")
        yield from super().tokens(prompt)


def test_engine_failure_is_reported(tokenizer: Tokenizer) -> None:
    with _running(create_app(FailingEngine(tokenizer, "fine"), "failing")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        status, body = _post(url, "/v1/completions", {"model": "failing", "prompt": "boom"})
        _assert_error(status, body, 500)
        assert body["error"]["type"] == "server_error" and "disk went away" in body["error"]["message"]
        with pytest.raises(openai.APIError, match="disk went away"):
            list(c.chat.completions.create(model="failing", messages=_chat("boom"), stream=True))
        # a failure before the first token is a proper error status, streaming or not: never a 200
        for stream in (False, True):
            status, body = _post(url, "/v1/completions", {"model": "failing", "prompt": "crash", "stream": stream})
            _assert_error(status, body, 500)
            assert "unreadable" in body["error"]["message"]
        # the worker survived
        assert c.completions.create(model="failing", prompt="ok").choices[0].text == "fine"
        assert _metrics(url)["moestream_requests_failed_total"] == 4


def test_body_too_large(scripted: str) -> None:
    body = {"model": "scripted", "prompt": "x" * 5000}
    _assert_error(*_post(scripted, "/v1/completions", body), 413, code="request_too_large")


def test_many_queued_requests(client: openai.OpenAI) -> None:
    """Ten clients at once all get answers (FIFO queue, one engine)."""
    out: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: out.append(
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0).usage.completion_tokens
            )
        )
        for _ in range(10)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [4] * 10
