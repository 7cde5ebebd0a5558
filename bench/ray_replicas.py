"""`serve-ray`: the aggregate decode rate of 2 engine replicas against 1 behind the same endpoint, 8 clients.

Each pair starts fresh servers one after the other (the order rotated every pair, each server's processes,
Ray's included, gone before the next starts), each `moestream serve-ray` with its own local Ray instance:
`1 replica` (one engine with --threads = the cores) and `2 replicas` (two engines with half the threads each),
so both arms use the same cores, which on a small machine are the ceiling: two engines can only beat one where
one leaves cores idle. A plain `moestream serve` with the threads of `1 replica` runs in every pair too (what
the Ray Serve path costs). Every server answers one warm-up request, then 8 clients send different prompts at
once (greedy, --tokens each); the figure is the completion tokens of all of them over the wall time from the
first send to the last answer. Beside it, the CPU seconds the server's processes (Ray's and the replicas' with
it) used in that window: the cores an arm kept busy, against the machine's (the ceiling).

    python bench/ray_replicas.py --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

from harness import log, run_meta, save_results, spread  # also puts this checkout first on sys.path

from moestream.synth.shapes import write_synth

WORDS = "cache disk route layer slot gate token batch".split()
SETTLE_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def start(args: argparse.Namespace, arm: str, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cores = os.cpu_count() or 1
    common = ["-m", args.model, "--port", str(port), "--ctx", "1024", "--model-name", "bench", "--log-level",
              "warning", "--no-webui", "--max-batch", "8"]  # fmt: skip
    if arm == "serve":
        cmd = ["serve", *common, "--threads", str(cores), "--ram-budget-mb", str(args.budget_mb)]
    else:
        n = 1 if arm == "1 replica" else 2
        cmd = ["serve-ray", *common, "--replicas", str(n), "--threads", str(max(1, cores // n)),
               "--ram-budget-mb", str(args.budget_mb)]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "moestream", *cmd], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    want = 2 if arm == "2 replicas" else 1
    deadline = time.monotonic() + 300
    while True:
        h = health(url)
        if h is not None and h.get("status") == "ok" and h.get("replicas", 1) >= want:
            return proc, url
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"{arm} did not start; see {log_path}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """End the server and wait until every process of its session (Ray's too) is gone, so that the next arm
    does not share the cores with a teardown."""
    if proc.poll() is None:
        proc.send_signal(2)  # SIGINT: serve-ray ends its local Ray instance
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and session_alive(proc.pid):
        time.sleep(0.5)
    time.sleep(SETTLE_S)


def session_cpu_s(sid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of the session `sid`: the server, and for
    serve-ray its Ray processes and replicas."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getsid(int(pid)) != sid:
                continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            pass
    return total


def session_alive(sid: int) -> bool:
    """Whether any process of the session `sid` (the server's, started with start_new_session) still runs."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getsid(int(pid)) == sid:
                    return True
            except OSError:
                pass
    return False


def clients(url: str, n: int, tokens: int) -> dict[str, Any]:
    """n clients at once; completion tokens, wall seconds, and each answer (the same in every arm)."""
    go = threading.Barrier(n + 1)
    out: dict[int, dict[str, Any]] = {}

    def one(i: int) -> None:
        go.wait()
        body = {"model": "bench", "prompt": f"Client {i} explains the {WORDS[i % len(WORDS)]} of a model",
                "max_tokens": tokens, "temperature": 0}  # fmt: skip
        out[i] = post(url, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    made = sum(out[i]["usage"]["completion_tokens"] for i in range(n))
    return {"tokens": made, "seconds": wall, "tok_s": made / wall, "texts": [out[i]["choices"][0]["text"]
                                                                              for i in range(n)]}  # fmt: skip


def run_arm(args: argparse.Namespace, arm: str, log_path: str) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc, url = start(args, arm, log_path)
    startup = time.perf_counter() - t0
    try:
        post(url, {"model": "bench", "prompt": "warm up", "max_tokens": 4, "temperature": 0})
        cpu0 = session_cpu_s(proc.pid)
        r = clients(url, args.clients, args.tokens)
        r["cpu_s"] = session_cpu_s(proc.pid) - cpu0
        r["cores_used"] = r["cpu_s"] / r["seconds"]
    finally:
        stop(proc)
    r.update(startup_s=startup, load_before=load_before, load_after=os.getloadavg()[0])
    log(f"  {arm}: {r['tok_s']:.1f} tok/s ({r['tokens']} tokens in {r['seconds']:.1f} s, {r['cores_used']:.2f} "
        f"cores), start {startup:.0f} s, load {load_before:.1f}")  # fmt: skip
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default="Q4_0")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budget-mb", type=int, default=3000, help="each replica's (and serve's) --ram-budget-mb")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--name", default="ray-replicas")
    ap.add_argument("--results-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ray-replicas-")
    args.model = write_synth(args.shape, args.quant, os.path.join(tmp, "m.gguf"), layers=args.layers, progress=False)
    arms = ["1 replica", "2 replicas", "serve"]
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for p in range(args.pairs):
        log(f"pair {p + 1}/{args.pairs}")
        for arm in arms[p % 3 :] + arms[: p % 3] if p % 2 == 0 else (arms[p % 3 :] + arms[: p % 3])[::-1]:
            runs[arm].append(run_arm(args, arm, os.path.join(tmp, f"{arm.replace(' ', '-')}-{p}.log")))
    same = all(r["texts"] == runs["serve"][0]["texts"] for rs in runs.values() for r in rs)
    ratio = [b["tok_s"] / a["tok_s"] for a, b in zip(runs["1 replica"], runs["2 replicas"], strict=True)]
    via_ray = [a["tok_s"] / s["tok_s"] for a, s in zip(runs["1 replica"], runs["serve"], strict=True)]
    import ray

    doc = {
        "meta": run_meta(
            args,
            ray=ray.__version__,
            cores=os.cpu_count(),
            note="a 2-core machine shared with other jobs: the ceiling is its cores",
        ),  # fmt: skip
        "tok_s": {a: spread(r["tok_s"] for r in rs) for a, rs in runs.items()},
        "cores_used": {a: spread(r["cores_used"] for r in rs) for a, rs in runs.items()},
        "cpu_ms_per_token": {a: spread(1e3 * r["cpu_s"] / r["tokens"] for r in rs) for a, rs in runs.items()},
        "ratio_2_over_1_replica": spread(ratio),
        "ratio_1_replica_over_serve": spread(via_ray),
        "pairs_ratio_2_over_1": ratio,
        "pairs_ratio_1_replica_over_serve": via_ray,
        "same_answers_in_every_arm": same,
        "runs": runs,
    }
    save_results(doc, "\n".join(table(doc)), args, args.name)
    log(f"model in {tmp}")
    return 0


def table(doc: dict[str, Any]) -> list[str]:
    def c(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    t = doc["tok_s"]
    return [
        "| 1 replica tok/s | 2 replicas tok/s | 2 / 1, pair by pair | serve tok/s | 1 replica / serve | same answers |",
        "|---|---|---|---|---|---|",
        f"| {c(t['1 replica'])} | {c(t['2 replicas'])} | {c(doc['ratio_2_over_1_replica'])}x | {c(t['serve'])} | "
        f"{c(doc['ratio_1_replica_over_serve'])}x | {doc['same_answers_in_every_arm']} |",
        "",
        "| arm | cores used (of " + str(doc["meta"]["cores"]) + ") | CPU ms per token |",
        "|---|---|---|",
        *(f"| {a} | {c(doc['cores_used'][a])} | {c(doc['cpu_ms_per_token'][a])} |" for a in t),
        "",
        f"pairs 2/1: {', '.join(f'{x:.2f}' for x in doc['pairs_ratio_2_over_1'])}; median "
        f"{statistics.median(doc['pairs_ratio_2_over_1']):.2f}",
    ]


if __name__ == "__main__":
    sys.exit(main())
