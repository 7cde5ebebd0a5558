"""The web page of `serve`: the engine events endpoint over HTTP, and the chat page and engine view in a real
browser (Debian's chromium driven by playwright) against `moestream serve` on a tiny model whose expert cache
is smaller than its experts, so that the cache streams while it answers."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from moestream.formats.gguf_file import GGUFFile
from moestream.formats.tokenizer import Tokenizer
from moestream.serving.app import create_app
from moestream.serving.webui import touched_tail
from moestream.synth.shapes import write_synth
from tests.test_server import ScriptedEngine, _get, _metrics, serve_process

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # fmt: skip
RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
KEY = "k-webui-123"
SECRET = "zebrafish-7731"  # a word of a prompt that the engine events must never carry


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    # F16: an expert takes 1 MiB of cache (widened), so the resident memory's drift of a few MiB between starts
    # moves the slots by a few, where a Q4_0 expert's 0.1 MiB would have let it hold all 64 or none
    return write_synth("tiny", "F16", tmp_path_factory.mktemp("model") / "tiny.gguf", progress=False)


@pytest.fixture(scope="module")
def server(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server with a --ram-budget-mb 12 MiB above the least it takes: fewer slots than experts. The least
    depends on the resident memory measured at start, which moves by a few MiB: a refusal names the new least."""
    budget = 64
    for _ in range(4):
        try:
            with serve_process(tiny, tmp_path_factory.mktemp("webui"), "--ram-budget-mb", str(budget),
                               "--max-batch", "2") as url:  # fmt: skip
                yield url
                return
        except pytest.fail.Exception as exc:
            least = re.search(r"at least --ram-budget-mb (\d+)", str(exc))
            if least is None:
                raise
            budget = int(least.group(1)) + 12
    pytest.fail("the server refused every budget near its least")


def _events(url: str, n: int, headers: dict[str, str] | None = None) -> tuple[int, list[tuple[str, Any]]]:
    """The first n events of /v1/engine/events (name, body), or the status of a refusal."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", "/v1/engine/events", headers=headers or {})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, [("error", json.loads(r.read()))]
        assert r.getheader("content-type", "").startswith("text/event-stream")
        out: list[tuple[str, Any]] = []
        name = ""
        while len(out) < n:
            line = r.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
        return 200, out
    finally:
        conn.close()


def _chat(url: str, text: str, max_tokens: int, headers: dict[str, str] | None = None) -> dict[str, Any]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
        )
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def test_touched_tail_finds_the_keys_used_since() -> None:
    before = {k: i for i, k in enumerate("abcde")}
    assert touched_tail(before, list("abcde")) == []
    assert touched_tail(before, list("acdeb")) == ["b"]  # b was used: it moved to the end
    assert touched_tail(before, list("bdeax")) == ["a", "x"]  # a used, x read (c evicted)
    assert touched_tail({}, list("ab")) == ["a", "b"]


@pytest.mark.slow  # starts a server: over 10 s
def test_engine_events(server: str) -> None:
    import threading

    answer: dict[str, Any] = {}
    talk = threading.Thread(target=lambda: answer.update(_chat(server, f"tell me of the {SECRET}", 120)))
    talk.start()
    status, events = _events(server, 13)  # three seconds of states while it answers
    talk.join()
    assert status == 200 and events[0][0] == "config"
    config = events[0][1]
    assert config["layers"] == 4 and config["experts"] == 16 and config["n_slots"] < 64  # the cache streams
    assert set(config["budget"]) >= {"resident_mib", "compute_mib", "reader_mib", "reserve_mib", "experts_mib"}
    states = [body for name, body in events[1:] if name == "state"]
    assert len(states) == 12
    for s in states:
        assert len(s["grid"]) == 4 and all(len(row) == 16 and set(row) <= set(".cpfh") for row in s["grid"])
    assert any(s["decode_tps"] > 0 for s in states) and any(s["disk_mb_s"] > 0 for s in states)
    assert any(s["hit_rate"] is not None for s in states)
    assert SECRET not in json.dumps(events) and "tell me" not in json.dumps(events)
    timings = answer["usage"]["timings"]
    assert timings["predicted_n"] == answer["usage"]["completion_tokens"] and timings["predicted_ms"] > 0


@pytest.mark.slow  # starts a server: over 10 s
def test_page_and_host_check(server: str) -> None:
    status, ctype, body = _get(server, "/")
    assert status == 200 and ctype.startswith("text/html") and b"/static/app.js" in body
    u = urlsplit(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/")
    assert "default-src 'self'" in conn.getresponse().getheader("content-security-policy", "")
    conn.close()
    assert _get(server, "/engine")[0] == 200 and _get(server, "/static/engine.js")[0] == 200
    assert _get(server, "/static/nothing.js")[0] == 404
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/", headers={"Host": f"rebound.example:{u.port}"})  # a DNS-rebinding page's request
    r = conn.getresponse()
    assert r.status == 403 and "127.0.0.1" in json.loads(r.read())["error"]["message"]
    conn.close()


@pytest.fixture(scope="module")
def keyed_server(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # the default budget: this server needs no streaming, and a fixed one may fall under what its start measures
    with serve_process(tiny, tmp_path_factory.mktemp("keyed"), "--api-key", KEY) as url:
        yield url


@pytest.mark.slow  # starts a server: over 10 s
def test_api_key_guards_the_events(keyed_server: str) -> None:
    status, events = _events(keyed_server, 1)
    assert status == 401 and events[0][1]["error"]["code"] == "invalid_api_key"
    status, events = _events(keyed_server, 2, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and [n for n, _ in events] == ["config", "state"]
    assert _get(keyed_server, "/")[0] == 200  # the page itself is public: it asks for the key


def test_no_webui_leaves_the_events_only(tiny: str) -> None:
    f = GGUFFile(tiny)
    tokenizer = Tokenizer.from_metadata(f.metadata)
    f.close()
    app = create_app(ScriptedEngine(tokenizer, "x"), "scripted", webui=False)
    paths = {getattr(r, "path", "") for r in app.routes}
    assert "/v1/engine/events" in paths and not {"/", "/engine", "/static/{name}"} & paths
    with TestClient(app) as c:
        assert c.get("/").status_code == 404
    paths = {getattr(r, "path", "") for r in create_app(ScriptedEngine(tokenizer, "x"), "scripted").routes}
    assert {"/", "/engine", "/static/{name}"} <= paths


# ------------------------------------------------------------------------------------------ the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (apt-get install -y chromium) for the browser tests")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (pip)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def _watch(page: Any, errors: list[str], outside: list[str]) -> None:
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: None if urlsplit(r.url).hostname == "127.0.0.1" else outside.append(r.url))


def _shot(page: Any, out: Path, name: str) -> None:
    page.screenshot(path=str(out / f"webui-{name}.png"), full_page=True)
    if RESULTS.is_dir():
        shutil.copy(out / f"webui-{name}.png", RESULTS / f"webui-{name}.png")


@pytest.mark.slow
def test_chat_and_engine_view_in_chromium(browser: Any, server: str, tmp_path: Path) -> None:
    errors: list[str] = []
    outside: list[str] = []
    # the page's Content-Security-Policy forbids eval, which playwright's wait_for_function uses
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, bypass_csp=True)
    page = ctx.new_page()
    _watch(page, errors, outside)
    page.goto(server + "/")
    page.click("#settings summary")
    page.fill("#set-max-tokens", "40")
    page.fill("#set-temperature", "0")
    # count how often the answer's text changes while it streams
    page.evaluate("""() => { window.updates = 0; new MutationObserver(() => window.updates++)
        .observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true}); }""")
    page.fill("#input", "Hello, who are you?")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant .meta .speed", timeout=60_000)
    answer = page.inner_text(".msg.assistant .body")
    assert answer.strip() and page.evaluate("window.updates") >= 5, page.evaluate("window.updates")
    assert "decode" in page.inner_text(".msg.assistant .speed") and "tok/s" in page.inner_text(".msg.assistant .speed")
    _shot(page, tmp_path, "chat")

    # a long answer, stopped mid-way: the server cancels the request
    before = _metrics(server)["moestream_requests_cancelled_total"]
    page.fill("#set-max-tokens", "1500")
    page.fill("#input", "Now a long story, please.")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant')[1]?.innerText.length > 40", timeout=60_000)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant >> nth=1 >> .meta", timeout=30_000)
    assert "stopped" in page.inner_text(".msg.assistant >> nth=1 >> .speed")
    deadline = time.monotonic() + 10
    while _metrics(server)["moestream_requests_cancelled_total"] <= before:
        assert time.monotonic() < deadline, "the server did not cancel the stopped request"
        time.sleep(0.1)
    m = _metrics(server)
    assert m["moestream_requests_running"] == 0

    # the engine view: its grid and hit rate move while an answer is generated
    page.click("#tab-engine")
    assert page.url.endswith("/engine")
    page.wait_for_function("window.moestreamEngine.states >= 2", timeout=30_000)
    changes = page.evaluate("window.moestreamEngine.gridChanges")
    page.click("#tab-chat")
    page.fill("#set-max-tokens", "200")
    page.fill("#input", "And one more answer.")
    page.keyboard.press("Enter")
    page.click("#tab-engine")
    page.wait_for_function(f"window.moestreamEngine.gridChanges > {changes} + 2", timeout=60_000)
    page.wait_for_function("document.querySelector('dd[data-name=\"decode\"]').textContent !== '0.0 tok/s'")
    assert "%" in page.inner_text("dd[data-name='hit rate']")
    _shot(page, tmp_path, "engine")
    page.click("#tab-chat")
    page.wait_for_selector(".msg.assistant >> nth=2 >> .meta", timeout=60_000)

    # reload: the conversation is kept (localStorage)
    page.reload()
    assert page.locator(".msg.user").count() == 3 and page.locator(".msg.assistant").count() == 3
    assert page.inner_text(".msg.assistant .body") == answer
    page.goto(server + "/engine")  # the engine view on its own
    page.wait_for_function("window.moestreamEngine.states >= 1", timeout=30_000)
    ctx.close()
    assert not errors, errors
    assert not outside, outside


@pytest.mark.slow
def test_the_page_asks_for_the_key_once(browser: Any, keyed_server: str, tmp_path: Path) -> None:
    errors: list[str] = []
    outside: list[str] = []
    ctx = browser.new_context(bypass_csp=True)
    page = ctx.new_page()
    _watch(page, errors, outside)
    page.goto(keyed_server + "/engine")
    page.wait_for_selector("#key-dialog[open]", timeout=30_000)
    page.fill("#key-input", KEY)
    page.keyboard.press("Enter")
    page.wait_for_function("window.moestreamEngine.states >= 1", timeout=30_000)
    # the name comes from its own request (the models list), which may answer after the first state
    page.wait_for_function("document.querySelector('#model-name').textContent !== ''", timeout=30_000)
    assert page.inner_text("#model-name") == "tiny"
    page.reload()  # the key is kept: no second question
    page.wait_for_function("window.moestreamEngine.states >= 1", timeout=30_000)
    assert page.locator("#key-dialog[open]").count() == 0
    ctx.close()
    # the 401s that made the page ask are logged by chromium as failed loads; nothing else may be
    assert all("401" in e for e in errors), errors
    assert not outside, outside
