"""A few hundred malformed and hostile requests against one running server: never a 5xx, never a 200 with
an error inside, errors in OpenAI's shape, and the server still answers a normal request afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from moestream.synth.shapes import write_synth
from tests.hostile_requests import MAX_TOKENS_DEFAULT, MODEL, Case, free_port, make_cases, send, start_server, table
from tests.hostile_requests import wait_healthy as _wait_healthy

N_CASES = 330


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    d = tmp_path_factory.mktemp("hostile")
    model = write_synth("tiny", "Q4_0", d / "tiny.gguf", progress=False)
    port = free_port()
    with open(d / "server.log", "w+") as log:
        proc = start_server(str(model), port, log)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc)
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except Exception:
                proc.kill()
                proc.wait()


def _normal(url: str) -> dict:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    out = send(url, Case("normal", body))
    assert out.status == 200 and out.defect is None, out
    return {}


@pytest.mark.slow
def test_hostile_requests(server) -> None:
    url, proc = server
    cases = make_cases(seed=15, n=N_CASES)
    outcomes = [send(url, c) for c in cases]
    defects = [o for o in outcomes if o.defect]
    assert not defects, (
        table(outcomes) + "\n" + "\n".join(f"{o.family} {o.status} {o.defect}: {o.detail}" for o in defects[:15])
    )
    assert proc.poll() is None, "the server died"
    _normal(url)
    # every family got answers, and the bad ones were refused rather than generated
    fams = {o.family for o in outcomes}
    assert len(fams) == 11
    assert sum(o.status == 400 for o in outcomes) > N_CASES // 3


def _post(url: str, body: object, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    status, data = r.status, r.read()
    conn.close()
    return status, json.loads(data) if r.getheader("content-type", "").startswith("application/json") else {}


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", float("nan"), "temperature"),
        ("temperature", float("inf"), "temperature"),
        ("temperature", -1, "temperature"),
        ("top_p", float("nan"), "top_p"),
        ("top_p", 0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("seed", 2**64, "seed"),
        ("seed", -1, "seed"),
        ("max_tokens", 10**9, "max_tokens"),
        ("chat_template_kwargs", {"messages": []}, "chat_template_kwargs"),
        ("chat_template_kwargs", {"bos_token": "x", "enable_thinking": False}, "chat_template_kwargs"),
        ("chat_template_kwargs", {"add_generation_prompt": False}, "chat_template_kwargs"),
    ],
)
def test_bad_values_are_400_naming_the_param(server, field: str, value: object, param: str, stream: bool) -> None:
    status, body = _post(server[0], {**CHAT, field: value, "stream": stream})
    assert status == 400, body
    assert body["error"]["param"] == param, body


def test_tiny_temperature_generates(server) -> None:
    for t in (1e-45, 5e-324):
        status, body = _post(server[0], {**CHAT, "temperature": t})
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_deep_json_is_400(server) -> None:
    for depth in (65, 100_000):
        raw = ("[" * depth + "]" * depth).encode()
        out = send(server[0], Case("deep", raw))
        assert out.status == 400 and out.defect is None, out
    ok = {**CHAT, "metadata": json.loads("[" * 60 + "]" * 60)}  # deep, but within the bound
    assert _post(server[0], ok)[0] == 200


def test_max_tokens_default(server) -> None:
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    status, doc = _post(server[0], {**body, "temperature": 0.0})
    assert status == 200 and doc["usage"]["completion_tokens"] <= MAX_TOKENS_DEFAULT
