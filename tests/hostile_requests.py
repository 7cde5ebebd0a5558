"""Malformed and hostile HTTP requests for the server, from a seed: the generator and the checks shared by
tests/test_server_hostile.py (a few hundred) and tools/fuzz_requests.py (thousands).

Every case is sent as raw bytes on its own connection, so bodies can be truncated, mislabelled or cut off
under their Content-Length. An outcome is a defect when the server answers 5xx, answers 200 with an error
inside (a JSON error body or an error event in the stream), sends an error that is not OpenAI's shape,
or does not answer at all.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

MODEL = "tiny"
MAX_TOKENS_DEFAULT = 8  # the server under test runs with --max-tokens-default 8
CTX = 512
RESERVED = ["messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "template",
            "raise_exception", "namespace", "dict", "strftime_now"]  # fmt: skip
ODD_NUMBERS = [float("nan"), float("inf"), float("-inf"), 1e-45, 5e-324, 1e308, -1, 0, 1, 0.5, 2, 10**30,
               -(10**30), 2**64, 2**64 - 1, 2**63, 1e-300, -0.0, 3.7]  # fmt: skip
WRONG = ["text", "", None, True, [], {}, [1, 2], {"a": 1}, "0.5", "NaN", 1.5]


@dataclass
class Case:
    family: str
    body: bytes
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    content_length: int | None = None  # None: the body's length
    raw: bytes | None = None  # the whole request as written (HTTP-level junk)
    max_completion: int | None = None  # a 200 may generate at most this many tokens


@dataclass
class Outcome:
    family: str
    status: int  # 0: no answer
    defect: str | None
    detail: str = ""


# ---- the generator -------------------------------------------------------------------------------


def _chat(rng: random.Random, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": rng.choice(["hi", "Tell me a story", "2+2?"])}],
        "max_tokens": rng.randint(1, 3),
        "temperature": 0,
    }
    if rng.random() < 0.3:
        body["stream"] = True
    body.update(kw)
    return body


def _completion(rng: random.Random, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": rng.randint(1, 3)}
    if rng.random() < 0.3:
        body["stream"] = True
    body.update(kw)
    return body


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def _deep(rng: random.Random, depth: int) -> str:
    kind = rng.choice(["list", "dict", "mixed"])
    if kind == "list":
        return "[" * depth + "]" * depth
    if kind == "dict":
        return '{"a":' * depth + "1" + "}" * depth
    out, close = "", ""
    for i in range(depth):
        out, close = (out + "[", "]" + close) if i % 2 else (out + '{"k":', "}" + close)
    return out + "0" + close


def deep_json(rng: random.Random) -> Case:
    depth = rng.choice([65, 66, 100, 1000, 10_000, 100_000, 30, 64])
    where = rng.choice(["top", "content", "kwargs", "unknown", "tools"])
    base = _chat(rng, max_tokens=1)
    slot = {
        "top": None,
        "content": ("messages", 0, "content"),
        "kwargs": ("chat_template_kwargs", "x"),
        "unknown": ("metadata",),
        "tools": ("tools",),
    }[where]
    if slot is None:
        return Case("deep_json", _deep(rng, depth).encode())
    target = base
    for key in slot[:-1]:
        target = target.setdefault(key, {}) if isinstance(key, str) else target[key]
    target[slot[-1]] = "__DEEP__"
    return Case("deep_json", _dump(base).replace(b'"__DEEP__"', _deep(rng, depth).encode()))


SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "seed", "max_tokens", "n", "max_completion_tokens"]


def numbers(rng: random.Random) -> Case:
    body = _chat(rng) if rng.random() < 0.7 else _completion(rng)
    name = rng.choice(SAMPLING_FIELDS if "messages" in body else SAMPLING_FIELDS[:6])
    body[name] = rng.choice(ODD_NUMBERS)
    if name in ("max_tokens", "max_completion_tokens") and body[name] in (10**30, 2**64, 2**63, 2**64 - 1):
        pass  # refused: above the context
    return Case("numbers", _dump(body), path="/v1/chat/completions" if "messages" in body else "/v1/completions")


def wrong_types(rng: random.Random) -> Case:
    chat = rng.random() < 0.7
    body = _chat(rng) if chat else _completion(rng)
    fields = list(body) + ["stop", "stream_options", "tools", "tool_choice", "logprobs", "n", "seed", "top_k"]
    if chat:
        fields += ["chat_template_kwargs", "max_completion_tokens"]
    else:
        fields += ["echo", "suffix", "best_of"]
    body[rng.choice(fields)] = rng.choice(WRONG)
    return Case("wrong_types", _dump(body), path="/v1/chat/completions" if chat else "/v1/completions")


def template_kwargs(rng: random.Random) -> Case:
    kwargs: dict[str, Any] = {}
    if rng.random() < 0.7:
        kwargs[rng.choice(RESERVED)] = rng.choice(["x", [], {}, None, 1, [{"role": "user", "content": "x"}]])
    if rng.random() < 0.6:
        kwargs[rng.choice(["enable_thinking", "x", "", "a b", "__class__", "_x", "loop"])] = rng.choice(WRONG)
    return Case("template_kwargs", _dump(_chat(rng, chat_template_kwargs=kwargs)))


def max_tokens(rng: random.Random) -> Case:
    chat = rng.random() < 0.6
    body = _chat(rng) if chat else _completion(rng)
    value = rng.choice(["absent", "absent", -1, 0, 1, 4, CTX + 1, 10**9, 2**63, -(2**63), 1.0, "4"])
    limit = None
    if value == "absent":
        body.pop("max_tokens")
        limit = MAX_TOKENS_DEFAULT if chat else 16  # completions keep OpenAI's own default of 16
    else:
        body["max_tokens"] = value
        limit = value if value in (1, 4) else None
    return Case("max_tokens", _dump(body), path="/v1/chat/completions" if chat else "/v1/completions",
                max_completion=limit)  # fmt: skip


def messages(rng: random.Random) -> Case:
    bad = rng.choice(
        [
            [],
            [{}],
            [{"role": "robot", "content": "x"}],
            [{"role": "user"}],
            [{"role": "user", "content": None}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": [{"text": "x"}]}],
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}],
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            [{"role": "tool", "content": "x"}],
            [{"role": "system", "content": "x"}],
            [{"role": "user", "content": "\ud800 lone surrogate"}],
            [{"role": "user", "content": "nul \x00 byte"}],
            [{"role": "user", "content": "the expert " * CTX}],
            [{"role": "user", "content": "x"}] * rng.randint(50, 300),
            [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}],
            "just text",
            None,
            [None],
            [["user", "x"]],
        ]
    )
    return Case("messages", _dump(_chat(rng, messages=bad)))


def prompts(rng: random.Random) -> Case:
    bad = rng.choice(
        [
            [],
            [[]],
            [-1],
            [10**9],
            [2**64],
            [1.5],
            ["a", "b"],
            [[1, 2], [3]],
            [[1, "a"]],
            "",
            "\ud800",
            [1] * CTX,
            "the expert " * CTX,
            {"a": 1},
            None,
            True,
            [None],
        ]  # fmt: skip
    )
    body = _completion(rng, prompt=bad)
    if rng.random() < 0.3:
        body[rng.choice(["echo", "suffix", "logprobs", "best_of"])] = rng.choice([True, "x", 2, 0, None])
    return Case("prompts", _dump(body), path="/v1/completions")


def content_types(rng: random.Random) -> Case:
    body = _dump(_chat(rng, max_tokens=1))
    ctype, data = rng.choice(
        [
            ("text/plain", body),
            ("application/x-www-form-urlencoded", b"model=tiny&messages=hi"),
            (
                "multipart/form-data; boundary=xyz",
                b"--xyz\r\nContent-Disposition: form-data; name=a\r\n\r\nb\r\n--xyz--",
            ),
            ("", body),
            ("application/json; charset=utf-16", body.decode().encode("utf-16")),
            ("application/json", b""),
            ("application/json", b"null"),
            ("application/json", b'"a string"'),
            ("application/json", b"12"),
            ("application/json", b"\xef\xbb\xbf" + body),
        ]
    )
    headers = {"Content-Type": ctype} if ctype else {}
    return Case("content_types", data, headers=headers)


def truncated(rng: random.Random) -> Case:
    body = _dump(_chat(rng) if rng.random() < 0.7 else _completion(rng))
    kind = rng.choice(["cut", "flip", "garbage", "short_length"])
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    if kind == "cut":
        return Case("truncated", body[: rng.randrange(len(body))], path=path)
    if kind == "flip":
        b = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return Case("truncated", bytes(b), path=path)
    if kind == "garbage":
        return Case("truncated", rng.randbytes(rng.randint(1, 200)), path=path)
    # the body ends before its Content-Length: the client half-closes and waits for an answer
    return Case("truncated", body[: len(body) // 2], path=path, content_length=len(body))


def unknown_fields(rng: random.Random) -> Case:
    chat = rng.random() < 0.6
    body = _chat(rng) if chat else _completion(rng)
    for _ in range(rng.randint(1, 5)):
        body[rng.choice(["user", "metadata", "store", "service_tier", "x" * 50, "", "__proto__", "frequency_penalty",
                         "presence_penalty", "logit_bias", "response_format", "parallel_tool_calls"])] = rng.choice(
            WRONG + ODD_NUMBERS[:3])  # fmt: skip
    return Case("unknown_fields", _dump(body), path="/v1/chat/completions" if chat else "/v1/completions")


def http_level(rng: random.Random) -> Case:
    kind = rng.choice(["method", "path", "huge_length", "junk", "models"])
    if kind == "method":
        return Case("http", b"", method=rng.choice(["GET", "PUT", "DELETE", "PATCH"]))
    if kind == "path":
        path = rng.choice(["/v1/nothing", "/v1/chat/completions/x", "/v1/models/%00", "/v1/models/" + "a" * 3000,
                           "/%ff", "/v1//completions"])  # fmt: skip
        return Case("http", b"{}", path=path)
    if kind == "huge_length":
        return Case("http", b"{}", content_length=10**12)
    if kind == "models":
        return Case("http", b"", method="GET", path=rng.choice(["/v1/models", "/health", "/metrics", "/v1/models/x"]))
    junk = rng.choice([b"GARBAGE\r\n\r\n", b"POST / HTTP/9.9\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00",
                       b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n"])  # fmt: skip
    return Case("http", b"", raw=junk)


FAMILIES = {
    "deep_json": deep_json,
    "numbers": numbers,
    "wrong_types": wrong_types,
    "template_kwargs": template_kwargs,
    "max_tokens": max_tokens,
    "messages": messages,
    "prompts": prompts,
    "content_types": content_types,
    "truncated": truncated,
    "unknown_fields": unknown_fields,
    "http": http_level,
}


def make_cases(seed: int, n: int) -> list[Case]:
    """n cases, the families in turn, each drawn from the seed."""
    rng = random.Random(seed)
    makers = list(FAMILIES.values())
    return [makers[i % len(makers)](rng) for i in range(n)]


# ---- sending and judging -------------------------------------------------------------------------


def _request_bytes(case: Case, host: str) -> bytes:
    if case.raw is not None:
        return case.raw
    length = len(case.body) if case.content_length is None else case.content_length
    head = [f"{case.method} {case.path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in case.headers.items()]
    if case.method in ("POST", "PUT", "PATCH") or case.body:
        head.append(f"Content-Length: {length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + case.body


def send(url: str, case: Case, timeout: float = 120) -> Outcome:
    u = urlsplit(url)
    try:
        with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
            sock.sendall(_request_bytes(case, f"{u.hostname}:{u.port}"))
            if case.content_length is not None or case.raw is not None:
                sock.shutdown(socket.SHUT_WR)  # no more body is coming
            r = http.client.HTTPResponse(sock, method=case.method)
            r.begin()
            data = r.read()
            return judge(case, r.status, r.getheader("content-type", ""), data)
    except (OSError, http.client.HTTPException) as exc:
        # junk that is not HTTP, and a body that ends before its Content-Length (the client hung up, as far
        # as the HTTP parser can tell), may just be hung up on
        cut = case.content_length is not None and case.content_length > len(case.body) and case.content_length < 2**20
        if case.raw is not None or cut:
            return Outcome(case.family, 0, None, f"hung up: {type(exc).__name__}")
        return Outcome(case.family, 0, "no answer", f"{type(exc).__name__}: {exc}")


def judge(case: Case, status: int, ctype: str, data: bytes) -> Outcome:
    def defect(kind: str) -> Outcome:
        return Outcome(case.family, status, kind, data[:300].decode("utf-8", "replace"))

    if status >= 500:
        return defect("5xx")
    ours = case.raw is None  # HTTP-level junk is answered by the HTTP parser, not the app
    if status == 200 and ctype.startswith("text/event-stream"):
        events = [line[6:] for line in data.decode("utf-8", "replace").splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return defect("stream without [DONE]")
        docs = [json.loads(e) for e in events[:-1]]
        if any("error" in d for d in docs):
            return defect("200 with an error in the stream")
        usage = next((d["usage"] for d in reversed(docs) if d.get("usage")), None)
        return _check_tokens(case, status, usage)
    if status == 200 and case.path.endswith("completions"):
        try:
            doc = json.loads(data)
        except ValueError:
            return defect("200 that is not JSON")
        if "error" in doc or not doc.get("choices"):
            return defect("200 with an error")
        return _check_tokens(case, status, doc.get("usage"))
    if status >= 400 and ours:
        try:
            err = json.loads(data)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
        except (ValueError, KeyError, TypeError, AssertionError):
            return defect("error not in OpenAI's shape")
    return Outcome(case.family, status, None)


def _check_tokens(case: Case, status: int, usage: dict[str, Any] | None) -> Outcome:
    if case.max_completion is not None and usage and usage["completion_tokens"] > case.max_completion:
        return Outcome(case.family, status, "max_tokens default not applied", str(usage))
    return Outcome(case.family, status, None)


def tally(outcomes: list[Outcome]) -> dict[str, tuple[int, int, Counter]]:
    """Per family, and over all of them under "all": (cases, defects, answers by status code)."""
    by: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by[o.family].append(o)
    by["all"] = list(outcomes)
    return {fam: (len(rows), sum(o.defect is not None for o in rows), Counter(o.status for o in rows))
            for fam, rows in by.items()}  # fmt: skip


def table(outcomes: list[Outcome]) -> str:
    """Per family: cases, answers by status code, defects."""
    lines = [f"{'family':<16} {'cases':>6}  {'defects':>7}  status codes"]
    counts = tally(outcomes)
    for fam in [*sorted(f for f in counts if f != "all"), "all"]:
        n, defects, codes = counts[fam]
        shown = " ".join(f"{c or 'none'}:{codes[c]}" for c in sorted(codes))
        lines.append(f"{fam:<16} {n:>6}  {defects:>7}  {shown}")
    return "\n".join(lines)


# ---- a server to send them to --------------------------------------------------------------------


def start_server(model: str, port: int, log: Any) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moestream", "serve", "-m", model, "--ram-budget-mb", "2000", "--ctx", str(CTX),
           "--port", str(port), "--model-name", MODEL, "--log-level", "critical",
           "--max-tokens-default", str(MAX_TOKENS_DEFAULT)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if send(url, Case("health", b"", method="GET", path="/health", headers={})).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not come up in time")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
