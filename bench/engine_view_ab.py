"""A/B: decode tok/s of `serve` with the engine view open (a client reading /v1/engine/events) and closed.

Each pair is a fresh `moestream serve` on a synthetic model under a budget that streams (the least the server
takes plus a margin, so its expert cache holds a fraction of the experts and the grid moves), one warm-up request,
then greedy requests back to back, whose decode speed is the server's own (usage.timings: generated tokens /
decode time), alternating: with an SSE client reading the events from before the request starts to after it
ends, and without; each arm's speed in a pair is the median of its requests, and the first arm alternates pair by
pair, so that other load on the machine (shared with other work) falls on both arms alike. The states' own
build times (build_ms) and the server's CPU time per request are kept too: tokens per CPU second depend far
less on the machine's other load than tokens per wall second, and count the view's thread with the engine's.

    python bench/engine_view_ab.py --pairs 5 --out bench/results/2026-12-04-engine-view-ab.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import git_commit, host_info, write_json  # noqa: E402

from moestream.serving.webui import SNAPSHOT_S  # noqa: E402
from moestream.synth.shapes import write_synth  # noqa: E402

PROMPT = "Experts live on disk and the cache keeps the ones"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def least_budget(cmd: list[str]) -> int:
    done = subprocess.run([*cmd, "--port", "0", "--ram-budget-mb", "64"], capture_output=True, text=True)
    return int(re.search(r"at least --ram-budget-mb (\d+)", done.stderr).group(1))


def chat(port: int, max_tokens: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out


class EventReader(threading.Thread):
    """An engine view: reads /v1/engine/events until stopped; keeps each state's build_ms."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.build_ms: list[float] = []
        self.done = threading.Event()

    @property
    def states(self) -> int:
        return len(self.build_ms)

    def run(self) -> None:
        self.conn.request("GET", "/v1/engine/events")
        r = self.conn.getresponse()
        while not self.done.is_set():
            line = r.readline()
            if not line:
                return
            if line.startswith(b"data: ") and b'"build_ms"' in line:
                self.build_ms.append(json.loads(line[6:])["build_ms"])

    def stop(self) -> None:
        self.done.set()
        self.conn.sock.shutdown(socket.SHUT_RDWR)


def start_server(cmd: list[str], budget: int) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port), "--ram-budget-mb", str(budget), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError as exc:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(f"the server did not start: {out}") from exc
            time.sleep(0.2)


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system, every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(port: int, pid: int, view: bool, tokens: int) -> dict[str, Any]:
    """One greedy request's decode speed and the server's CPU time over it; view: with an events reader
    connected (it got a state first)."""
    reader = EventReader(port) if view else None
    if reader:
        reader.start()
        while reader.states < 1:
            time.sleep(0.05)
    cpu0 = cpu_s(pid)
    answer = chat(port, tokens)
    cpu = cpu_s(pid) - cpu0
    if reader:
        reader.stop()
    t = answer["usage"]["timings"]
    return {"view": view, "decode_tps": t["predicted_n"] / (t["predicted_ms"] / 1000), "tokens": t["predicted_n"],
            "cpu_s": cpu, "tokens_per_cpu_s": t["predicted_n"] / cpu if cpu > 0 else None,
            "states_read": reader.states if reader else 0,
            "build_ms": reader.build_ms[1:] if reader else []}  # fmt: skip


def one_pair(cmd: list[str], budget: int, first: bool, tokens: int, repeats: int) -> dict[str, Any]:
    """A fresh server, a warm-up request, then `repeats` requests of each arm alternating (the first one's arm:
    view `first`); each arm's speed is the median of its requests (the machine's other load comes in bursts)."""
    proc, port = start_server(cmd, budget)
    try:
        chat(port, 16)
        runs = [measure(port, proc.pid, first if i % 2 == 0 else not first, tokens) for i in range(2 * repeats)]
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    arms = {view: [r for r in runs if r["view"] == view] for view in (False, True)}
    tps = {view: statistics.median(r["decode_tps"] for r in arms[view]) for view in arms}
    per_cpu = {view: statistics.median(r["tokens_per_cpu_s"] for r in arms[view]) for view in arms}
    return {"closed_tps": tps[False], "open_tps": tps[True], "ratio": tps[True] / tps[False],
            "closed_tokens_per_cpu_s": per_cpu[False], "open_tokens_per_cpu_s": per_cpu[True],
            "cpu_ratio": per_cpu[True] / per_cpu[False],
            "first": "open" if first else "closed", "runs": runs}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3, help="requests of each arm per pair")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--quant", default="F16")
    ap.add_argument("--margin-mb", type=int, default=12, help="budget above the least the server takes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = write_synth(args.shape, args.quant, os.path.join(tempfile.mkdtemp(), "m.gguf"), progress=False)
    cmd = [sys.executable, "-m", "moestream", "serve", "-m", model, "--ctx", "1024", "--max-batch", "1",
           "--model-name", "m"]  # fmt: skip
    budget = least_budget(cmd) + args.margin_mb
    pairs = []
    for i in range(args.pairs):
        pair = one_pair(cmd, budget, i % 2 == 1, args.tokens, args.repeats)
        pairs.append(pair)
        built = [ms for r in pair["runs"] for ms in r["build_ms"]]
        print(f"pair {i}: closed {pair['closed_tps']:.2f} open {pair['open_tps']:.2f} tok/s, ratio "
              f"{pair['ratio']:.3f}; tokens per CPU second ratio {pair['cpu_ratio']:.3f} (states built in "
              f"{statistics.median(built):.2f} ms median)",
              flush=True)  # fmt: skip
    ratios = [p["ratio"] for p in pairs]
    cpu = [p["cpu_ratio"] for p in pairs]
    doc = {
        "what": "decode tok/s with the engine view open (an SSE client on /v1/engine/events) / closed",
        "shape": args.shape, "quant": args.quant, "budget_mb": budget, "tokens": args.tokens,
        "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
        "median_cpu_ratio": statistics.median(cpu), "min_cpu_ratio": min(cpu), "max_cpu_ratio": max(cpu),
        "median_closed_tps": statistics.median(p["closed_tps"] for p in pairs),
        "median_open_tps": statistics.median(p["open_tps"] for p in pairs),
        "median_build_ms": statistics.median(ms for p in pairs for r in p["runs"] for ms in r["build_ms"]),
        "states_per_s": 1 / SNAPSHOT_S,
        "pairs": pairs, "host": host_info(model), "commit": git_commit(),
    }  # fmt: skip
    write_json(args.out, doc)
    print(
        f"median ratio {doc['median_ratio']:.3f} (min {doc['min_ratio']:.3f}, max {doc['max_ratio']:.3f}); tokens "
        f"per CPU second {doc['median_cpu_ratio']:.3f} ({doc['min_cpu_ratio']:.3f}-{doc['max_cpu_ratio']:.3f})"
    )


if __name__ == "__main__":
    main()
