"""long_prompt.py's report: the markdown tables and the plot of prefill tok/s against prompt length."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
from harness import GIB, MIB, spread  # noqa: E402
from harness import cell as spread_cell  # noqa: E402

ENGINES = ("moestream", "llama.cpp")


def cell(s: dict[str, float] | None, suffix: str = "") -> str:
    """harness.cell, with an exact zero (llama.cpp's prompt reads when the file is cached) written as 0."""
    if s is not None and s["min"] == s["max"] == 0:
        return "0"
    return spread_cell(s, suffix=suffix)


def scaled(s: dict[str, float] | None, factor: float) -> dict[str, float] | None:
    """A median (min-max) cell divided by a constant (the order of the runs stays the same)."""
    if s is None:
        return None
    return {k: (v / factor if k != "n" else v) for k, v in s.items()}


def condition_title(cond: dict[str, Any], meta: dict[str, Any]) -> str:
    if cond["condition"] == "pressure":
        return f"pressure ({meta['args']['leave_gb']:g} GiB left)"
    return cond["condition"]


def length_rows(cond: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    routed = meta["routed_bytes"]
    title = condition_title(cond, meta)
    rows: list[str] = []
    for n in meta["args"]["lengths"]:
        first = True
        for engine in ENGINES:
            s = cond["summary"].get(f"{engine} | {n} tokens")
            if s is None:
                continue
            mt = s["metrics"]
            ok = s["statuses"].get("ok", 0)
            bad = ", ".join(f"{k} {st}" for st, k in s["statuses"].items() if st != "ok")
            disk = mt.get("prompt_disk_bytes")
            rows.append(
                f"| {title if first and n == meta['args']['lengths'][0] else ''} | {n if first else ''} | {engine} | "
                f"{ok}/{s['runs']}{f' ({bad})' if bad else ''} | {cell(mt.get('prompt_tps'))} | "
                f"{cell(mt.get('ttft_s'))} | {cell(scaled(disk, MIB))} | {cell(scaled(disk, routed), suffix='x')} | "
                f"{cell(mt.get('peak_rss_mb'))} |"
            )
            first = False
        ratio = cond["ratios"].get(str(n), {})
        pairs = ratio.get("prompt_tps", {}).get("n", 0)
        rows.append(
            f"| | | **moestream / llama.cpp** | {pairs} pairs | **{cell(ratio.get('prompt_tps'), suffix='x')}** | "
            f"{cell(ratio.get('ttft_s'), suffix='x')} | {cell(ratio.get('prompt_disk_bytes'), suffix='x')} | | |"
        )
    return rows


def agent_rows(cond: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    agent = cond.get("agent")
    if not agent:
        return []
    ok = [r for r in agent["runs"] if r["status"] == "ok"]
    lines = [
        "",
        f"Agent turn, {condition_title(cond, meta)}: `moestream serve --prompt-cache-mb {agent['prompt_cache_mb']}`"
        f", a {agent['first_tokens']}-token prompt, then it + the answer + {agent['new_tokens']} new tokens "
        f"({len(ok)}/{len(agent['runs'])} servers ok).",
        "",
        "| turn | prompt tokens | cached tokens | first token s | disk MiB (whole request) |",
        "|---|---|---|---|---|",
    ]
    for i, name in enumerate(("first", "second")):
        turns = [r["turns"][i] for r in ok]
        lines.append(
            f"| {name} | {cell(spread(t['prompt_tokens'] for t in turns))} | "
            f"{cell(spread(t['cached_tokens'] for t in turns))} | {cell(spread(t['ttft_s'] for t in turns))} | "
            f"{cell(spread(t['read_bytes'] / MIB if t['read_bytes'] is not None else None for t in turns))} |"
        )
    lines.append(f"| **second / first** | | | **{cell(agent.get('ttft_ratio'), suffix='x')}** | |")
    lines += [
        f"- server {r['repeat'] + 1}: {r['status']}: {r['log_tail']}" for r in agent["runs"] if r["status"] != "ok"
    ]
    return lines


def markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    host, args = meta["host"], meta["args"]
    lines = [
        f"### Long prompts, moestream vs llama.cpp: {os.path.basename(meta['model'])} "
        f"({meta['model_bytes'] / 1e9:.1f} GB, routed experts {meta['routed_bytes'] / 1e9:.2f} GB)",
        "",
        f"{meta['date']}, {host['cpu']}, {host['cores']} cores, {host['mem_total_bytes'] / GIB:.0f} GiB RAM; "
        f"{args['threads']} threads, {args['tokens']} tokens generated, {args['repeat']} pairs of fresh processes "
        f"per length; prompts: {meta['corpus']['source']}, Python {meta['corpus']['python']}; moestream "
        f"{meta['moestream_commit']}, llama.cpp {meta['llama_variant']}.",
        "Cells: median (min-max). Ratios pair by pair. First token: process start to the end of the prefill "
        "(load included). Prompt disk: bytes the kernel read for the process during the prefill; x routed: "
        "that over the routed experts' size.",
        "",
        "| condition | prompt tokens | engine | runs ok | prefill tok/s | first token s | prompt disk MiB | "
        "x routed | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for cond in doc["conditions"]:
        lines += length_rows(cond, meta)
        if "error" in cond:
            notes.append(f"{condition_title(cond, meta)}: stopped early: {cond['error']}")
        for r in cond["runs"]:
            if r["status"] != "ok":
                notes.append(
                    f"{r['engine']}, {r['variant']}, pair {r['repeat'] + 1}: {r['status']} {r['error'][-200:]}"
                )
    for cond in doc["conditions"]:
        lines += agent_rows(cond, meta)
    for n, view in meta["tokenization"].items():
        if not view["same_ids"]:
            notes.append(
                f"{n} tokens: llama.cpp tokenizes the text to {view['llama_tokens']} tokens (moestream "
                f"{view['moestream_tokens']}), ids differ from position {view['first_diff']}"
            )
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str) -> None:
    """Prefill tok/s against prompt length, per condition and engine: medians, min-max as error bars."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = doc["meta"]["args"]["lengths"]
    styles = {"moestream": ("tab:blue", "o"), "llama.cpp": ("tab:orange", "s")}
    for cond in doc["conditions"]:
        dashed = cond["condition"] == "pagecache"
        for engine in ENGINES:
            xs, med, lo, hi = [], [], [], []
            for n in lengths:
                s = cond["summary"].get(f"{engine} | {n} tokens", {}).get("metrics", {}).get("prompt_tps")
                if s:
                    xs.append(n)
                    med.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
            if not xs:
                continue
            color, marker = styles[engine]
            ax.errorbar(
                xs,
                med,
                yerr=[lo, hi],
                color=color,
                marker=marker,
                capsize=4,
                linestyle="--" if dashed else "-",
                label=f"{engine}, {condition_title(cond, doc['meta'])}",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tok/s (median, min-max)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Prefill: {os.path.basename(doc['meta']['model'])}, {doc['meta']['args']['threads']} threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
