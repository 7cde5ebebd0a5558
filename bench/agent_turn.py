"""An agent's second turn against `moestream serve`: one fresh server, a first request with a long prompt, then
a second that extends it (the first prompt + the first answer + new text), both streamed.

Per request: time to first token (request sent -> first SSE chunk; the server sends its status line only
with the first token, so this is the prefill as a client sees it), the usage it reports
(`prompt_tokens_details.cached_tokens`: prompt tokens restored from the prompt cache instead of prefilled),
and the disk bytes the server read during the request (/proc/PID/io). Prompts go as token ids to
/v1/completions, so the server prefills exactly the ids given; the first answer is re-encoded from its text,
as a client that only sees text would send it back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai
from harness import REPO_DIR, Measured, make_oom_victim, oom_kills, proc_read_bytes, tail

from moestream.formats.tokenizer import Tokenizer

MODEL_NAME = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (stop() reaps it with wait4 for its rusage)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def wait_healthy(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if exited(proc.pid):
            raise RuntimeError("the server exited before answering /health")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s")


def request(client: openai.OpenAI, pid: int, ids: list[int] | str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion of token ids (or a text, which the server tokenizes): time to its first chunk, its
    whole time, usage and the disk bytes read."""
    io0 = proc_read_bytes(pid)
    t0 = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage = None
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    io1 = proc_read_bytes(pid)
    details = usage.prompt_tokens_details if usage is not None else None
    return {
        "prompt_tokens_sent": len(ids) if isinstance(ids, list) else None,
        "ttft_s": first,
        "total_s": total,
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "cached_tokens": details.cached_tokens if details is not None else None,
        "completion_tokens": usage.completion_tokens if usage is not None else None,
        "read_bytes": io1 - io0 if io0 is not None and io1 is not None else None,
        "text": "".join(text),
    }


def serve_cmd(
    model: str,
    port: int,
    ctx: int | None,
    threads: int,
    budget_mb: int | None,
    cache_mb: int,
    extra: list[str],
    tree: str | None = None,
):
    """`moestream serve` greedy on the port; tree: that checkout's moestream package (as engine_runs.run_moestream)."""
    cmd = [*(["env", f"PYTHONPATH={os.path.abspath(tree)}"] if tree else []), sys.executable, *(["-P"] if tree else [])]
    cmd += ["-m", "moestream", "serve", "-m", model, "--port", str(port), *(["--ctx", str(ctx)] if ctx else [])]
    cmd += ["--threads", str(threads), "--prompt-cache-mb", str(cache_mb), "--temp", "0", "--seed", "0"]
    cmd += ["--model-name", MODEL_NAME, "--log-level", "warning", *extra]
    return cmd + (["--ram-budget-mb", str(budget_mb)] if budget_mb is not None else [])


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60) -> tuple[int, int]:
    """SIGTERM, then SIGKILL after grace_s; (exit code, peak RSS bytes from wait4)."""
    if not exited(proc.pid):
        os.kill(proc.pid, signal.SIGTERM)
    t0 = time.perf_counter()
    while True:
        pid, wstatus, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - t0 > grace_s:
            os.killpg(proc.pid, signal.SIGKILL)
            grace_s = float("inf")
        time.sleep(0.1)
    rc = os.waitstatus_to_exitcode(wstatus)
    proc.returncode = rc
    return rc, ru.ru_maxrss * 1024


@dataclass
class Served:
    """One fresh `moestream serve` (run_server): its process and client, and once stopped, how it ended."""

    proc: subprocess.Popen[bytes]
    started: float  # perf_counter at its start
    client: openai.OpenAI | None = None
    load_s: float | None = None  # start -> /health answered
    status: str = "ok"
    rc: int | None = None
    peak_rss: int = 0
    log: str = ""


def run_server(cmd: list[str], port: int, timeout_s: float, work: Callable[[Served], None]) -> Served:
    """Start `cmd` (a serve_cmd on `port`), wait for /health, run `work` against it, then stop it. A server that
    never answers or a request that fails ends as status "failed: ...", a kill as "oom-killed" (the kernel's
    OOM killer) or "killed (SIGKILL)"; the server's output is kept in `log`."""
    kills_before = oom_kills()
    with tempfile.TemporaryFile() as log_file:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=make_oom_victim, start_new_session=True,
            cwd=REPO_DIR,
        )  # fmt: skip
        served = Served(proc, t0)
        try:
            wait_healthy(proc, port, timeout_s)
            served.load_s = time.perf_counter() - t0
            served.client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=timeout_s, max_retries=0
            )
            work(served)
        except (RuntimeError, openai.OpenAIError) as exc:
            served.status = f"failed: {exc}"
        finally:
            served.rc, served.peak_rss = stop(proc)
            if served.rc == -signal.SIGKILL and oom_kills() > kills_before:
                served.status = "oom-killed"
            elif served.rc == -signal.SIGKILL and served.status == "ok":
                served.status = "killed (SIGKILL)"
            log_file.seek(0)
            served.log = log_file.read().decode("utf-8", "replace")
    return served


def agent_turn(
    model: str,
    tok: Tokenizer,
    first_ids: list[int],
    new_ids: list[int],
    *,
    answer_tokens: int,
    ctx: int,
    threads: int,
    budget_mb: int | None,
    cache_mb: int,
    extra: list[str],
    timeout_s: float,
) -> dict[str, Any]:
    """Both turns in one fresh server; the second's prompt = first_ids + the re-encoded answer + new_ids."""
    port = free_port()
    cmd = serve_cmd(model, port, ctx, threads, budget_mb, cache_mb, extra)
    doc: dict[str, Any] = {"cmd": cmd, "status": "ok", "turns": []}

    def turns(served: Served) -> None:
        assert served.client is not None
        doc["load_s"] = served.load_s
        first = request(served.client, served.proc.pid, first_ids, answer_tokens)
        answer_ids = tok.encode(first["text"], add_bos=False)
        second = request(served.client, served.proc.pid, first_ids + answer_ids + new_ids, answer_tokens)
        doc["turns"] = [first, second]
        doc["answer_tokens_reencoded"] = len(answer_ids)
        if first["ttft_s"] and second["ttft_s"] is not None:
            doc["ttft_ratio"] = second["ttft_s"] / first["ttft_s"]

    served = run_server(cmd, port, timeout_s, turns)
    doc["status"], doc["rc"], doc["peak_rss"] = served.status, served.rc, served.peak_rss
    doc["log_tail"] = tail(served.log, 5)
    return doc


def served_prompt(
    model: str,
    prompt: str,
    tokens: int,
    threads: int,
    budget_mb: int | None,
    extra: list[str],
    timeout_s: float,
    tree: str | None = None,
) -> tuple[Measured, dict[str, Any]]:
    """One request in a fresh `moestream serve`: the text prompt, `tokens` greedy tokens streamed. Returns the
    outside view and stats in the keys of `moestream run --stats-json` that a client can measure (the prefill is
    the time to the first chunk; decode the tokens after it). bench/ab.py --serve runs its arms this way; its
    parameters are engine_runs.run_moestream's, so that ab.py calls either."""
    port = free_port()
    cmd = serve_cmd(model, port, None, threads, budget_mb, 0, extra, tree)
    stats: dict[str, Any] = {}
    wall_s = 0.0

    def one_request(served: Served) -> None:
        nonlocal wall_s
        assert served.client is not None
        r = request(served.client, served.proc.pid, prompt, tokens)
        wall_s = time.perf_counter() - served.started  # start to the answer's end, as a `run` process's life
        decoded = (r["completion_tokens"] or 1) - 1  # the first token comes with the prefill
        decode_s = r["total_s"] - r["ttft_s"]
        stats.update(
            prompt_tokens=r["prompt_tokens"],
            prompt_s=r["ttft_s"],
            prompt_tps=r["prompt_tokens"] / r["ttft_s"],
            decode_tokens=decoded,
            decode_s=decode_s,
            decode_tps=decoded / decode_s if decoded and decode_s > 0 else None,
            prompt_bytes_read=r["read_bytes"],
        )

    served = run_server(cmd, port, timeout_s, one_request)
    return Measured(cmd, served.status, served.rc, wall_s, served.peak_rss, 0, 0, stderr=served.log), stats
