"""A model file truncated under a running server: the next request gets 503 and the server exits with one
line (exit 2), and an idle server notices it on its own."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from moestream.synth.shapes import write_synth


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _start(path: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moestream", "serve", "-m", path, "--ram-budget-mb", "2000", "--ctx", "256",
           "--port", str(port), "--model-name", "m", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc
        except OSError:
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("idle", [False, True])
def test_truncated_model_file_stops_the_server(model: str, tmp_path, idle: bool) -> None:
    path = str(tmp_path / "copy.gguf")
    shutil.copy(model, path)
    port = _free_port()
    proc = _start(path, port)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        status, _ = _post(url, {"model": "m", "prompt": "hello", "max_tokens": 3})
        assert status == 200
        with open(path, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        if not idle:
            status, body = _post(url, {"model": "m", "prompt": "hello again", "max_tokens": 3})
            assert status == 503 and "changed" in body["error"]["message"], body
        _, err = proc.communicate(timeout=60)  # idle: the worker's periodic check stops it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "changed while moestream was running" in lines[0], err
    assert "Traceback" not in err
