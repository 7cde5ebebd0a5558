"""A/B: decode tok/s of `serve` with the engine view open (a client reading /v1/engine/events) and closed.

Each run is a fresh `moestream serve` on a synthetic model under a budget that streams (the least the server
takes plus a margin, so its expert cache holds a fraction of the experts and the grid moves), one warm-up request,
then one greedy request whose decode speed is the server's own (usage.timings: generated tokens / decode time).
Run B keeps an SSE client reading the events from before the warm-up to after the answer. Pairs interleave, the
order alternating (AB, BA, ...), so that other load on the machine falls on both arms alike.

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
    """An engine view: reads /v1/engine/events until stopped; counts the states it got."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.states = 0
        self.done = threading.Event()

    def run(self) -> None:
        self.conn.request("GET", "/v1/engine/events")
        r = self.conn.getresponse()
        while not self.done.is_set():
            line = r.readline()
            if not line:
                return
            self.states += line.startswith(b"event: state")

    def stop(self) -> None:
        self.done.set()
        self.conn.sock.shutdown(socket.SHUT_RDWR)


def one_run(cmd: list[str], budget: int, view: bool, tokens: int) -> dict[str, Any]:
    port = free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port), "--ram-budget-mb", str(budget), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {proc.stdout.read() if proc.stdout else ''}")
                time.sleep(0.2)
        reader = EventReader(port) if view else None
        if reader:
            reader.start()
        chat(port, 16)  # warm-up
        answer = chat(port, tokens)
        if reader:
            reader.stop()
        t = answer["usage"]["timings"]
        return {"view": view, "decode_tps": t["predicted_n"] / (t["predicted_ms"] / 1000), "tokens": t["predicted_n"],
                "states_read": reader.states if reader else 0}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200)
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
        order = (False, True) if i % 2 == 0 else (True, False)
        runs = {view: one_run(cmd, budget, view, args.tokens) for view in order}
        ratio = runs[True]["decode_tps"] / runs[False]["decode_tps"]
        pairs.append({"closed": runs[False], "open": runs[True], "ratio": ratio, "order": ["open" if v else "closed"
                      for v in order]})  # fmt: skip
        print(f"pair {i}: closed {runs[False]['decode_tps']:.2f} open {runs[True]['decode_tps']:.2f} tok/s, "
              f"ratio {ratio:.3f} ({runs[True]['states_read']} states read)", flush=True)  # fmt: skip
    ratios = [p["ratio"] for p in pairs]
    doc = {
        "what": "decode tok/s with the engine view open (an SSE client on /v1/engine/events) / closed",
        "shape": args.shape, "quant": args.quant, "budget_mb": budget, "tokens": args.tokens,
        "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
        "median_closed_tps": statistics.median(p["closed"]["decode_tps"] for p in pairs),
        "median_open_tps": statistics.median(p["open"]["decode_tps"] for p in pairs),
        "pairs": pairs, "host": host_info(model), "commit": git_commit(),
    }  # fmt: skip
    write_json(args.out, doc)
    print(f"median ratio {doc['median_ratio']:.3f} (min {doc['min_ratio']:.3f}, max {doc['max_ratio']:.3f})")


if __name__ == "__main__":
    main()
