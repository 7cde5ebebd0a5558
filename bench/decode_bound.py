"""The memory-bandwidth floor of a decode step, and the largest decode ratio to llama.cpp it allows.

    python bench/decode_bound.py --model /tmp/models/glm5-l6.gguf --compare bench/results/X-pressure.json

A decoded token reads, at least once, every weight it uses: every tensor but the routed experts and the token
embedding (one row of it), plus top_k experts in each MoE layer (their bytes in the file: the lane form has the
same bits); the KV cache a short context adds is left out. Those bytes over the machine's read bandwidth with the
run's threads (a torch reduction over a buffer much larger than the caches, the median of --repeat) are the floor
of a decode step, whatever the engine and however the experts are cached. Given a compare.py results file,
llama.cpp's median decode speed there divided by the floor's speed is the most any engine can reach against it on
this machine; the file's moestream figure sits beside it.

No engine computes at the read bandwidth: its one-token matmul streams weights at some rate below it. So the
kernel floor is measured too: moestream's lane matmul of one token (the kernel a decode step runs) on the file's
largest dense matrix and on one routed expert's gate matrix, each copied until the copies outgrow the caches
and multiplied in turn (--threads, the median of --repeat rounds): the token's dense bytes at the first rate
plus its routed bytes at the second are the fastest decode step this engine's kernels allow, and llama.cpp's
time over it the largest ratio they can reach.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from harness import add_results_args, run_meta, save_results


def token_bytes(path: str) -> dict[str, float]:
    """Bytes one decoded token reads from the weights, by part, and the shape facts they come from."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    top_k = int(r.fields[f"{arch}.expert_used_count"].parts[-1][0])
    routed: dict[int, int] = {}
    experts = 0
    dense = 0
    for t in r.tensors:
        if "_exps" in t.name:
            layer = int(t.name.split(".")[1])
            routed[layer] = routed.get(layer, 0) + int(t.n_bytes)
            experts = max(experts, int(t.shape[-1]))
        elif not t.name.startswith("token_embd"):
            dense += int(t.n_bytes)
    per_token_routed = sum(top_k * n / experts for n in routed.values())
    return {"architecture": arch, "top_k": top_k, "experts": experts, "moe_layers": len(routed),
            "dense_bytes": dense, "routed_bytes_per_token": per_token_routed,
            "bytes_per_token": dense + per_token_routed}  # fmt: skip


def read_bandwidth(threads: int, repeat: int, nbytes: int = 2 << 30) -> list[float]:
    """GB/s of a float32 sum over nbytes with `threads` threads, one figure per call after a warm-up."""
    torch.set_num_threads(threads)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        buf.sum()
        out.append(nbytes / (time.perf_counter() - t) / 1e9)
    return out


def _matrices(path: str) -> list[tuple[str, int, int, int, bytes]]:
    """(what, type, rows, cols, raw bytes): the file's largest dense 2-D matrix, and routed expert 0's gate."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    dense = [t for t in r.tensors if len(t.shape) == 2 and "_exps" not in t.name and "token_embd" not in t.name
             and "output" != t.name.split(".")[0]]  # fmt: skip
    big = max(dense, key=lambda t: int(t.n_bytes))
    gate = next(t for t in r.tensors if t.name.endswith("ffn_gate_exps.weight"))
    k, n = int(gate.shape[0]), int(gate.shape[1])
    one = int(gate.n_bytes) // int(gate.shape[2])
    raw_big = bytes(big.data.reshape(-1).view("uint8"))
    raw_gate = bytes(gate.data.reshape(-1).view("uint8")[:one])
    return [(big.name, int(big.tensor_type), int(big.shape[1]), int(big.shape[0]), raw_big),
            ("expert 0 of " + gate.name, int(gate.tensor_type), n, k, raw_gate)]  # fmt: skip


def kernel_rates(path: str, threads: int, repeat: int, total: int = 768 << 20) -> dict[str, dict]:
    """GB/s of moestream's one-token lane matmul on each of `_matrices`, copies totalling `total` bytes."""
    import numpy as np

    from moestream.compute import linear, native

    native.set_threads(threads)
    out = {}
    for what, ggml_type, n, k, raw in _matrices(path):
        first = linear.from_gguf(np.frombuffer(raw, np.uint8), ggml_type, n, k, False)
        if first.kind != "lane":
            continue
        copies = [first] + [linear.from_gguf(np.frombuffer(raw, np.uint8), ggml_type, n, k, False)
                            for _ in range(max(1, total // first.nbytes) - 1)]  # fmt: skip
        x = torch.randn(1, k)
        for c in copies:
            c.mm(x)
        rates = []
        for _ in range(repeat):
            t = time.perf_counter()
            for c in copies:
                c.mm(x)
            rates.append(sum(c.nbytes for c in copies) / (time.perf_counter() - t) / 1e9)
        out[what] = {"type": ggml_type, "rows": n, "cols": k, "copies": len(copies), "gb_s": rates,
                     "gb_s_median": statistics.median(rates)}  # fmt: skip
    return out


def decode_medians(path: str) -> dict[str, float]:
    """Median decode tok/s of each engine in a compare.py results file (its first condition)."""
    with open(path) as f:
        doc = json.load(f)
    runs = doc["conditions"][0]["runs"]
    out = {}
    for engine in ("moestream", "llama.cpp"):
        tps = [r["stats"]["decode_tps"] for r in runs if r["engine"] == engine and r.get("status") == "ok"]
        if tps:
            out[engine] = statistics.median(tps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--compare", help="a compare.py results file on the same model: llama.cpp's decode speed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=9)
    add_results_args(ap, None)
    args = ap.parse_args()
    need = token_bytes(args.model)
    bw = read_bandwidth(args.threads, args.repeat)
    gbs = statistics.median(bw)
    floor_ms = need["bytes_per_token"] / (gbs * 1e9) * 1e3
    doc = {"meta": run_meta(args), "token": need, "read_gb_s": bw, "read_gb_s_median": gbs,
           "floor_ms_per_token": floor_ms, "floor_tok_s": 1e3 / floor_ms}  # fmt: skip
    rows = [
        f"| bytes a token reads | {need['bytes_per_token'] / 1e6:.0f} MB ({need['dense_bytes'] / 1e6:.0f} dense, "
        f"{need['routed_bytes_per_token'] / 1e6:.0f} routed: {need['top_k']} of {need['experts']} experts x "
        f"{need['moe_layers']} layers) |",
        f"| read bandwidth, {args.threads} threads | {gbs:.1f} GB/s ({min(bw):.1f}-{max(bw):.1f}) |",
        f"| decode floor | {floor_ms:.1f} ms a token = {1e3 / floor_ms:.1f} tok/s |",
    ]
    rates = kernel_rates(args.model, args.threads, args.repeat)
    doc["kernel"] = rates
    kernel_ms = None
    if len(rates) == 2:
        dense_rate, routed_rate = (v["gb_s_median"] for v in rates.values())
        kernel_ms = (need["dense_bytes"] / dense_rate + need["routed_bytes_per_token"] / routed_rate) / 1e6
        doc["kernel_floor_ms_per_token"] = kernel_ms
        rows.append(f"| one-token lane matmul, {args.threads} threads | " + ", ".join(
            f"{w}: {v['gb_s_median']:.1f} GB/s ({min(v['gb_s']):.1f}-{max(v['gb_s']):.1f})" for w, v in rates.items())
            + " |")  # fmt: skip
        rows.append(f"| kernel floor | {kernel_ms:.1f} ms a token = {1e3 / kernel_ms:.1f} tok/s |")
    if args.compare:
        med = decode_medians(args.compare)
        doc["compare"] = {"file": args.compare, "decode_tps_median": med}
        if "llama.cpp" in med:
            doc["max_ratio_to_llama_cpp"] = 1e3 / floor_ms / med["llama.cpp"]
            rows.append(f"| llama.cpp's decode there | {med['llama.cpp']:.2f} tok/s: the floor allows at most "
                        f"**{doc['max_ratio_to_llama_cpp']:.2f}x** |")  # fmt: skip
            if kernel_ms is not None:
                doc["max_ratio_at_kernel_rate"] = 1e3 / kernel_ms / med["llama.cpp"]
                rows.append(f"| at the kernels' rate | at most **{doc['max_ratio_at_kernel_rate']:.2f}x** |")
        if "moestream" in med:
            doc["moestream_of_floor"] = med["moestream"] / (1e3 / floor_ms)
            rows.append(f"| moestream's decode there | {med['moestream']:.2f} tok/s, "
                        f"{doc['moestream_of_floor']:.2f}x the floor's speed |")  # fmt: skip
    md = "\n".join([f"### Decode's memory floor: {args.model}", "", "| what | figure |", "|---|---|", *rows])
    save_results(doc, md, args, "decode-bound")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
