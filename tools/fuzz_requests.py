"""Send thousands of malformed and hostile HTTP requests to one `moestream serve` on a tiny model and print
the outcomes per family (the generator and the checks are tests/hostile_requests.py).

    python tools/fuzz_requests.py --cases 2000 --seed 1

A defect is a 5xx, a 200 with an error inside, an error not in OpenAI's shape, or no answer; the exit
status is 1 if there was any, or if the server died or stopped answering normal requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moestream.synth.shapes import write_synth  # noqa: E402
from tests.hostile_requests import (  # noqa: E402
    MODEL,
    Case,
    free_port,
    make_cases,
    send,
    start_server,
    table,
    tally,
    wait_healthy,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", help="a model to serve (default: a tiny synthetic one)")
    ap.add_argument("--show", type=int, default=20, help="defects to list (default 20)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the outcomes per family as JSON")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_synth("tiny", "Q4_0", Path(tmp) / "tiny.gguf", progress=False))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(Path(tmp) / "server.log", "w+") as log:
            proc = start_server(model, port, log)
            try:
                wait_healthy(url, proc)
                t0 = time.monotonic()
                outcomes = []
                for i, case in enumerate(make_cases(args.seed, args.cases)):
                    outcomes.append(send(url, case))
                    if proc.poll() is not None:
                        print(f"the server died at case {i} ({case.family})", file=sys.stderr)
                        break
                elapsed = time.monotonic() - t0
                body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                after = send(url, Case("normal", body.encode()))
                alive = proc.poll() is None and after.status == 200 and after.defect is None
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    defects = [o for o in outcomes if o.defect]
    print(table(outcomes))
    print(f"{len(outcomes)} requests in {elapsed:.1f} s; server {'alive and answering' if alive else 'NOT answering'}")
    for o in defects[: args.show]:
        print(f"  {o.family} {o.status} {o.defect}: {o.detail}")
    if args.json:
        write_json(args.json, outcomes, args, elapsed, alive)
    return 0 if alive and not defects else 1


def write_json(path: str, outcomes: list, args: argparse.Namespace, seconds: float, alive: bool) -> None:
    per_family = {
        fam: {**{str(code): n for code, n in codes.items()}, "defects": defects}
        for fam, (_, defects, codes) in tally(outcomes).items()
    }
    doc = {
        "tool": "tools/fuzz_requests.py",
        "seed": args.seed,
        "requests": len(outcomes),
        "seconds": round(seconds, 1),
        "server_alive_after": alive,
        "status_codes": per_family,
        "defects": [{"family": o.family, "status": o.status, "defect": o.defect, "detail": o.detail} for o in outcomes
                    if o.defect],
    }  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
