"""The replay's command-line side: cache sizes read from a spec, and the results as a table and a plot."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from matplotlib import ticker
from matplotlib.figure import Figure

from moestream.analysis.accesses import Accesses, ReplayResult
from moestream.analysis.workload import slot_ladder
from moestream.errors import MoestreamError


def replay_table(results: Sequence[ReplayResult]) -> str:
    """An aligned text table, one row per (policy, size)."""
    head = ("policy", "capacity", "admission", "slots", "decode hit %", "MB/token", "reads/token", "prompt hit %")
    rows = [head]
    for r in results:
        rows.append(
            (
                r.policy,
                r.capacity,
                r.admission,
                str(r.slots),
                f"{100 * r.hit_rate:.2f}",
                f"{r.mb_per_token:.1f}",
                f"{r.misses_per_token:.1f}",
                f"{100 * r.prompt_hit_rate:.2f}" if r.prompt_hits + r.prompt_misses else "-",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[c].ljust(widths[c]) if c < 3 else row[c].rjust(widths[c]) for c in range(len(head))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_replay(
    results: Sequence[ReplayResult], path: str | os.PathLike[str], title: str = "", live: ReplayResult | None = None
) -> None:
    """PNG of decode hit rate vs cache size, one line per policy, Belady dashed as the ceiling."""
    fig = Figure(figsize=(7, 4.5), dpi=110)  # no pyplot: no global backend or figure registry to touch
    ax = fig.subplots()
    series: dict[str, list[ReplayResult]] = {}
    for r in results:
        label = r.policy + (" per-layer" if r.per_layer else "")
        if r.admission != "all":
            label += f" [{r.admission}]"
        series.setdefault(label, []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r.slots)
        x = [r.slots for r in rs]
        y = [100 * r.hit_rate for r in rs]
        if rs[0].policy == "belady":
            ax.plot(x, y, "k--", lw=2, label=f"{label} (ceiling)", zorder=3)
        else:
            ax.plot(x, y, marker="o", ms=4, label=label)
    if live is not None and live.slots:
        ax.plot([live.slots], [100 * live.hit_rate], "r*", ms=14, label="live (engine)", zorder=4)
    xs = sorted({r.slots for r in results})
    if len(xs) > 1 and xs[0] > 0 and xs[-1] / xs[0] >= 4:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())  # 256, not 2^8
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("cache slots (experts)")
    ax.set_ylabel("decode hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "expert cache replay")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.fspath(path))


def parse_slots(spec: str, meta: dict[str, Any] | None = None) -> list[int]:
    """'256,512,1024', '256:4096' (powers of two between), 'engine' (the trace's n_slots), or a mix."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if part == "engine":
                n = int((meta or {}).get("n_slots") or 0)
                if n < 1:
                    raise MoestreamError("the trace has no n_slots in its metadata; give sizes with --slots")
                out.append(n)
            elif ":" in part:
                lo, hi = (int(x) for x in part.split(":"))
                if lo < 1 or hi < lo:
                    raise ValueError
                n = lo
                while n <= hi:
                    out.append(n)
                    n *= 2
            else:
                out.append(int(part))
        except ValueError:
            raise MoestreamError(
                f"cannot read slot sizes {spec!r}; write e.g. 256,512,1024 or 256:4096 or engine"
            ) from None
    if not out or min(out) < 1:
        raise MoestreamError(f"slot sizes must be positive numbers, got {spec!r}")
    return sorted(set(out))


def default_slots(acc: Accesses) -> list[int]:
    """Powers of two from one token's experts to every expert, plus the engine's own size."""
    total = acc.n_layers * acc.n_experts
    top_k = int(acc.meta.get("top_k") or max(1, round(len(acc.keys) / max(acc.n_groups, 1))))
    return slot_ladder(1 << max(0, math.ceil(math.log2(max(1, acc.n_layers * top_k)))), total, acc.meta)
