"""The remote expert tier on one machine: what a decode token costs with its experts computed by Ray actors
against the same experts computed here from the cache, and, with a round trip injected per layer (a simulated
LAN), the latency at which the remote RAM tier still beats reading those experts from this disk.

Arms, alternated call by call in one process (harness.alternate): `local` (every expert cached here,
preloaded), `remote` (every expert held by --workers actors, the local cache empty of them), and `remote+D`
(the same with D ms slept once per layer before the workers' outputs are taken: the calls of one layer go out
together, so a network adds about one round trip per layer). The disk's side is the physical bound: the
top-k experts' bytes per layer at the bandwidth `moestream probe` measures on this file (4 reads in flight,
O_DIRECT), plus the local compute.

    python bench/ray_experts.py --layers 2 --rounds 11
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from harness import alternate, log, run_meta, save_results  # also puts this checkout first on sys.path

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.synth.shapes import write_synth


def probe_mb_s(model: str, out_dir: str) -> float:
    """This disk's O_DIRECT bandwidth at the model's expert segment size, 4 reads in flight."""
    path = os.path.join(out_dir, "probe.json")
    cmd = [sys.executable, "-m", "moestream", "probe", "--file", model, "--inflight", "4", "--direct-only",
           "--reads-per-row", "64", "-o", path]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    with open(path) as f:
        rows = json.load(f)["rows"]
    seg = max(r["size"] for r in rows)
    return max(r["mb_s"] for r in rows if r["size"] == seg)


def delayed(remote, delay_s: float):
    """The tier's collect with one simulated round trip per layer (all workers' calls of a layer overlap)."""
    collect = remote.collect

    def collect_after_rtt(layer, pending):
        time.sleep(delay_s)
        return collect(layer, pending)

    return collect_after_rtt


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default="Q4_0")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--delays-ms", default="0.5,2", help="round trips injected per layer, ms")
    ap.add_argument("--name", default="ray-experts")
    ap.add_argument("--results-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ray-experts-")
    args.model = write_synth(args.shape, args.quant, os.path.join(tmp, "m.gguf"), layers=args.layers, progress=False)
    mb_s = probe_mb_s(args.model, tmp)
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # a shared machine near full: keep the actors
    import ray

    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        object_store_memory=200 << 20,
        include_dashboard=False,
        log_to_driver=False,
    )
    local = Engine(args.model, EngineOptions(n_slots=args.layers * 128 + 8))
    local.preload()
    remote = Engine(args.model, EngineOptions(n_slots=16, ray_address="local", expert_workers=args.workers))
    cfg, store = local.cfg, local.store
    prompt = list(range(10, 42))
    local.forward(prompt, 0)
    remote.forward(prompt, 0)
    pos, tok = len(prompt), [7]
    arms = {"local": lambda: local.forward(tok, pos), "remote": lambda: remote.forward(tok, pos)}
    plain = remote.remote.collect
    delays = [float(d) for d in args.delays_ms.split(",") if d]
    times: dict[str, list[float]] = {}
    for d in [None, *delays]:
        if d is not None:
            remote.remote.collect = delayed(remote.remote, d / 1e3)
        t = alternate(arms, args.rounds)
        remote.remote.collect = plain
        key = "remote" if d is None else f"remote+{d}ms"
        times.setdefault("local", []).extend(t["local"])
        times[key] = t["remote"]
        times[f"ratio {key}"] = [r / a for r, a in zip(t["remote"], t["local"], strict=True)]
    assert torch_equal(local, remote, tok, pos), "the remote tier changed the logits"
    expert_bytes = store.expert_file_nbytes[0]
    disk_layer_s = cfg.top_k * expert_bytes / (mb_s * 1e6)
    t_local = statistics.median(times["local"])
    t_remote = statistics.median(times["remote"])
    overhead_layer_s = (t_remote - t_local) / cfg.n_layers
    breakeven_ms = (disk_layer_s - overhead_layer_s) * 1e3
    doc = {
        "meta": run_meta(
            args,
            workers=args.workers,
            layers=cfg.n_layers,
            top_k=cfg.top_k,
            hidden=cfg.hidden,
            expert_bytes=expert_bytes,
            probe_mb_s=mb_s,
            ray=ray.__version__,
        ),  # fmt: skip
        "seconds_per_token": {k: summary(v) for k, v in times.items() if not k.startswith("ratio")},
        "ratios": {k: summary(v) for k, v in times.items() if k.startswith("ratio")},
        "raw": times,
        "remote_overhead_ms_per_layer": overhead_layer_s * 1e3,
        "disk_ms_per_layer_bound": disk_layer_s * 1e3,
        "breakeven_rtt_ms_per_layer": breakeven_ms,
        "remote_calls": remote.remote.remote_calls,
    }
    lines = table(doc, cfg.top_k, expert_bytes, mb_s)
    save_results(doc, "\n".join(lines), args, args.name)
    remote.close()
    local.close()
    ray.shutdown()
    log(f"model in {tmp}")
    return 0


def table(doc: dict, top_k: int, expert_bytes: int, mb_s: float) -> list[str]:
    """The markdown table of the arms, and the break-even line."""
    overhead_layer_s = doc["remote_overhead_ms_per_layer"] / 1e3
    disk_layer_s = doc["disk_ms_per_layer_bound"] / 1e3
    breakeven_ms = doc["breakeven_rtt_ms_per_layer"]
    lines = ["| arm | ms/token median (min-max) | vs local, pair by pair |", "|---|---|---|"]
    for k, v in doc["seconds_per_token"].items():
        r = doc["ratios"].get(f"ratio {k}")
        ratio = f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" if r else "1"
        lines.append(f"| {k} | {v['median'] * 1e3:.2f} ({v['min'] * 1e3:.2f}-{v['max'] * 1e3:.2f}) | {ratio} |")
    lines.append(f"\nremote overhead {overhead_layer_s * 1e3:.2f} ms/layer; disk bound {disk_layer_s * 1e3:.2f} "
                 f"ms/layer ({top_k} x {expert_bytes / 2**20:.2f} MiB at {mb_s:.0f} MB/s); break-even round "
                 f"trip {breakeven_ms:.2f} ms/layer")  # fmt: skip
    return lines


def torch_equal(a: Engine, b: Engine, tok: list[int], pos: int) -> bool:
    import torch

    return bool(torch.equal(a.forward(tok, pos), b.forward(tok, pos)))


if __name__ == "__main__":
    sys.exit(main())
