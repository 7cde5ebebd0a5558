"""One `moestream serve` process with N concurrent greedy streaming clients, and the bound its trace sets.

`serve_streams` starts a fresh server (the OOM killer's first choice, as every measured process here),
optionally warms its expert cache with one long prompt, sends N completions requests at the same instant
through the `openai` client (streaming, temperature 0, the prompt as token ids so its length is exact),
records when each stream's text chunks arrive, reads /metrics before and after, stops the server with
SIGINT (so its trace is flushed) and returns what it saw.

`union_stats` reads that trace: the decode steps during which every stream decodes, the distinct experts
each of them fetched per layer (one fetch per (step, layer, expert) for the union), and from the file's
tensor sizes the bytes a step reads from RAM: the dense weights once (attention, norms, router, shared
experts, output head) plus the union's experts.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from harness import REPO_DIR, make_oom_victim, proc_read_bytes, tail
from openai import OpenAI

from moestream.analysis.trace import DECODE, PROMPT, read_trace
from moestream.formats.gguf_model import GGUFModel

MODEL_NAME = "bench"
_BLK = re.compile(r"^blk\.(\d+)\.")


# ---- the file's tensor sizes ---------------------------------------------------------------------


@dataclass
class ReadSizes:
    """Bytes a decode step reads from RAM: `dense` once per step, `expert[layer]` per distinct expert."""

    dense: int
    expert: dict[int, int]
    n_experts: int
    top_k: int
    vocab: int

    def expert_bytes(self, layer: int) -> int:
        return self.expert.get(layer, int(np.mean(list(self.expert.values()))))


def read_sizes(model: str) -> ReadSizes:
    """Routed experts are the `*_exps*` tensors; the token embedding reads one row per token, so it counts
    only when it doubles as the output head (no output.weight)."""
    f = GGUFModel(model)
    try:
        n_experts = int(f.arch_key("expert_count"))
        top_k = int(f.arch_key("expert_used_count"))
        vocab = len(f.get("tokenizer.ggml.tokens") or [])
        dense, per_layer = 0, {}
        tied = "output.weight" not in f.tensors
        for name, t in f.tensors.items():
            if "_exps" in name:
                m = _BLK.match(name)
                layer = int(m.group(1)) if m else -1
                per_layer[layer] = per_layer.get(layer, 0) + t.nbytes
            elif name != "token_embd.weight" or tied:
                dense += t.nbytes
    finally:
        f.close()
    return ReadSizes(dense, {k: v // n_experts for k, v in per_layer.items()}, n_experts, top_k, vocab)


# ---- the trace -----------------------------------------------------------------------------------


def union_stats(trace: str, sizes: ReadSizes) -> dict[str, Any]:
    """Union statistics over the decode steps in which every stream decodes: those after the last prompt
    step, up to the first step whose first row's position does not follow the previous one (the first
    admitted stream finished; with equal prompt lengths it is the first to end, so the window is exact)."""
    _meta, rows = read_trace(trace)
    prompt_steps = rows["step"][rows["phase"] == PROMPT]
    last_prompt = int(prompt_steps.max()) if len(prompt_steps) else -1
    dec = rows[(rows["phase"] == DECODE) & (rows["step"] > last_prompt)]
    if len(dec) == 0:
        return {"steps": 0}
    steps, first = np.unique(dec["step"], return_index=True)
    tokens = dec["token"][first]
    breaks = np.nonzero(np.diff(tokens) != 1)[0]
    n_full = int(breaks[0]) + 1 if len(breaks) else len(steps)
    dec = dec[np.isin(dec["step"], steps[:n_full])]
    layers = np.unique(dec["layer"])
    # rows per (step, layer) = distinct experts fetched for the union
    key = dec["step"].astype(np.int64) * (int(layers.max()) + 1) + dec["layer"]
    _, counts = np.unique(key, return_counts=True)
    expert_bytes = np.array([sizes.expert_bytes(int(layer)) for layer in dec["layer"]], dtype=np.float64)
    step_bytes = sizes.dense + expert_bytes.sum() / n_full
    one_stream = sizes.dense + sizes.top_k * sum(sizes.expert_bytes(int(layer)) for layer in layers)
    return {
        "steps": n_full,
        "decode_steps_after_prompts": len(steps),
        "layers": len(layers),
        "distinct_per_layer_mean": float(counts.mean()),
        "distinct_per_layer_min": int(counts.min()),
        "distinct_per_layer_max": int(counts.max()),
        "dense_bytes": sizes.dense,
        "expert_bytes_per_step": float(expert_bytes.sum() / n_full),
        "bytes_per_step": float(step_bytes),
        "bytes_per_one_stream_step": float(one_stream),
        "disk_rows": int((dec["source"] == 2).sum()),
    }


def bound_speedup(n: int, u: dict[str, Any]) -> float | None:
    """Aggregate speedup over one stream if a step's time were its RAM bytes: N x (1-stream bytes) / (bytes)."""
    if not u.get("steps"):
        return None
    return n * u["bytes_per_one_stream_step"] / u["bytes_per_step"]


# ---- prompts -------------------------------------------------------------------------------------


def prompt_ids(vocab: int, length: int, seed: int) -> list[int]:
    """A prompt of exactly `length` token ids, different per seed; ids from the middle of the vocabulary keep
    clear of the special tokens at either end."""
    lo, hi = min(1000, vocab // 4), max(min(30000, vocab - 1000), vocab // 2)
    return np.random.default_rng(1000 + seed).integers(lo, hi, size=length).tolist()


# ---- the server ----------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str
    started_s: float = 0.0

    def get(self, path: str, timeout: float = 10.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name.removeprefix("moestream_")] = float(value)
        return out

    def log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return tail(f.read(), 4)
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, flags: list[str], timeout_s: float) -> Server:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="batch-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "moestream", "serve", "-m", model, "--port", str(port), "--model-name",
           MODEL_NAME, "--temp", "0", "--log-level", "warning", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, preexec_fn=make_oom_victim,
                            start_new_session=True, cwd=REPO_DIR)  # fmt: skip
    os.close(fd)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {server.log_tail()}")
        try:
            server.get("/health", timeout=2)
            server.started_s = time.perf_counter() - t0
            return server
        except OSError:
            time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"serve did not answer /health within {timeout_s:.0f} s: {server.log_tail()}")


def stop_server(server: Server, grace_s: float = 60.0) -> dict[str, Any]:
    """SIGINT (the trace and the engine close cleanly), SIGKILL after grace_s; peak RSS from wait4."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
    t0 = time.perf_counter()
    while True:
        pid, status, ru = os.wait4(server.proc.pid, os.WNOHANG)
        if pid:
            server.proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.perf_counter() - t0 > grace_s:
            os.killpg(server.proc.pid, signal.SIGKILL)
            grace_s = float("inf")
        time.sleep(0.1)
    out = {"rc": server.proc.returncode, "ru_maxrss": ru.ru_maxrss * 1024, "log_tail": server.log_tail()}
    os.unlink(server.log_path)
    return out


# ---- the clients ---------------------------------------------------------------------------------


@dataclass
class Stream:
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival time of each text chunk
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""

    @property
    def first(self) -> float:
        return self.chunks[0]

    @property
    def last(self) -> float:
        return self.chunks[-1]


def complete(
    url: str, prompt: list[int], tokens: int, stream: bool = True, timeout_s: float = 3600, out: Stream | None = None
) -> Stream:
    """One greedy completion; a streamed one fills `out` as its chunks arrive."""
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout_s)
    out = out or Stream()
    out.sent = time.perf_counter()
    if not stream:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=tokens, temperature=0)
        out.chunks.append(time.perf_counter())
        out.completion_tokens = r.usage.completion_tokens if r.usage else 0
        return out
    chunks = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    for chunk in chunks:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            out.chunks.append(now)
        if chunk.choices and chunk.choices[0].finish_reason:
            out.finish_reason = chunk.choices[0].finish_reason
        if chunk.usage:
            out.completion_tokens = chunk.usage.completion_tokens
    return out


def run_streams(server: Server, prompts: list[list[int]], tokens: int, timeout_s: float) -> dict[str, Any]:
    """N streaming clients released at the same instant. Aggregate rate: tokens generated from the moment
    every stream has its first token to the last stream's end, over that time. A chunk is one token's text
    except where the server holds back an incomplete character, so the split of tokens at that moment can
    be off by one or two; the totals are the server's own usage counts."""
    n = len(prompts)
    streams: list[Stream] = [Stream() for _ in range(n)]
    barrier = threading.Barrier(n)
    io_marks: list[int | None] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            barrier.wait()
            complete(server.url, prompts[i], tokens, timeout_s=timeout_s, out=streams[i])
        except Exception as exc:  # a failed stream is a result; the others go on
            streams[i].error = f"{type(exc).__name__}: {exc}"

    # the disk bytes the server read while all streams decode: sampled when the last stream starts
    def watch_first() -> None:
        while not io_marks:
            with lock:
                started = sum(1 for s in streams if s.chunks)
                if started == n or any(s.error for s in streams):
                    io_marks.append(proc_read_bytes(server.proc.pid))
            time.sleep(0.005)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    watcher = threading.Thread(target=watch_first, daemon=True)
    for t in threads:
        t.start()
    watcher.start()
    for t in threads:
        t.join()
    io_end = proc_read_bytes(server.proc.pid)
    return summarize_streams(streams, io_marks[0] if io_marks else None, io_end)


def summarize_streams(streams: list[Stream], io_start: int | None, io_end: int | None) -> dict[str, Any]:
    errors = [s.error for s in streams if s.error or not s.chunks]
    per = [
        {
            "ttft_s": s.first - s.sent,
            "tokens": s.completion_tokens,
            "chunks": len(s.chunks),
            "finish_reason": s.finish_reason,
            "decode_tps": (s.completion_tokens - 1) / (s.last - s.first) if s.last > s.first else None,
        }
        for s in streams
        if s.chunks
    ]
    out: dict[str, Any] = {"per_stream": per, "errors": [e or "no text" for e in errors]}
    if errors:
        return out
    t_start, t_end = max(s.first for s in streams), max(s.last for s in streams)
    before = sum(sum(1 for c in s.chunks if c <= t_start) for s in streams)
    in_window = sum(s.completion_tokens for s in streams) - before
    out |= {
        "window_s": t_end - t_start,
        "window_tokens": in_window,
        "aggregate_tps": in_window / (t_end - t_start) if t_end > t_start else None,
        "ttft_last_s": max(p["ttft_s"] for p in per),
        "ttft_first_s": min(p["ttft_s"] for p in per),
        "tokens_total": sum(s.completion_tokens for s in streams),
    }
    if io_start is not None and io_end is not None and in_window:
        out["window_disk_mb_per_token"] = (io_end - io_start) / 2**20 / in_window
    return out
