"""serve-ray's /metrics: every replica's Prometheus text (serving/worker.py's metrics_text) with a `replica`
label, and the aggregate of all of them without one.

Each replica sends its text to a board (a small named Ray actor of the application) every REPORT_S; the
ingress reads the board when /metrics is asked for. A replica that stopped reporting for STALE_S (it died, or
Ray Serve replaced it) drops out of both. Counters, the histogram and the gauges that count things (requests
queued, cache entries, bytes, slots) add up over the replicas; the hit rate and bytes per token are computed
again from the summed counters; speeds of the last request and the context length are per replica only.
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict

REPORT_S = 1.0
STALE_S = 10.0
BOARD_NAME = "moestream-metrics"  # + the application's name

# gauges that do not add up over replicas: recomputed from the sums, or left per replica
RECOMPUTED = {  # name: (numerator, the counters whose sum is the denominator)
    "moestream_expert_cache_hit_rate": (
        "moestream_expert_cache_hits_total",
        ("moestream_expert_cache_hits_total", "moestream_expert_cache_misses_total"),
    ),
    "moestream_disk_read_bytes_per_generated_token": (
        "moestream_disk_read_bytes_total",
        ("moestream_generated_tokens_total",),
    ),
    "moestream_generated_tokens_per_busy_second": (
        "moestream_generated_tokens_total",
        ("moestream_busy_seconds_total",),
    ),
}
PER_REPLICA_ONLY = {
    "moestream_last_prompt_tokens_per_second",
    "moestream_last_decode_tokens_per_second",
    "moestream_context_tokens",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


class MetricsBoard:
    """Ray actor body: the latest metrics text of each replica, and when it came."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[str, float]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (text, time.monotonic())

    def drop(self, replica: str) -> None:
        self.texts.pop(replica, None)

    def fresh(self) -> dict[str, str]:
        now = time.monotonic()
        for name in [r for r, (_, t) in self.texts.items() if now - t > STALE_S]:
            del self.texts[name]
        return {r: text for r, (text, _) in sorted(self.texts.items())}


class _Family:
    def __init__(self) -> None:
        self.head: list[str] = []  # HELP and TYPE lines
        self.kind = "gauge"
        self.total: OrderedDict[tuple[str, str], float] = OrderedDict()  # (sample name, labels) -> sum
        self.rows: list[str] = []  # per replica


def combined_text(texts: dict[str, str]) -> str:
    """One exposition: each family's aggregate sample(s), then the same with replica="NAME" per replica."""
    families: OrderedDict[str, _Family] = OrderedDict()
    for replica, text in texts.items():
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                fam = families.setdefault(parts[2], _Family())
                if len(fam.head) < 2 and line not in fam.head:
                    fam.head.append(line)
                if parts[1] == "TYPE":
                    fam.kind = parts[3]
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, value = m.group(1), (m.group(2) or "{}")[1:-1], float(m.group(3))
            fam = families.setdefault(_family_of(name, families), _Family())
            fam.total[(name, labels)] = fam.total.get((name, labels), 0.0) + value
            fam.rows.append(f"{name}{{{_with_replica(labels, replica)}}} {_num(value)}")
    lines = [
        "# HELP moestream_replicas replicas reporting their metrics",
        "# TYPE moestream_replicas gauge",
        f"moestream_replicas {len(texts)}",
    ]
    sums = {name: v for fam in families.values() for (name, labels), v in fam.total.items() if not labels}
    for fname, fam in families.items():
        lines += fam.head
        if fname in RECOMPUTED:
            num, den = sums.get(RECOMPUTED[fname][0], 0.0), sum(sums.get(n, 0.0) for n in RECOMPUTED[fname][1])
            lines.append(f"{fname} {_num(num / den if den else 0.0)}")
        elif fname not in PER_REPLICA_ONLY:
            lines += [
                f"{n}{{{labels}}} {_num(v)}" if labels else f"{n} {_num(v)}" for (n, labels), v in fam.total.items()
            ]
        lines += fam.rows
    return "\n".join(lines) + "\n"


def _family_of(sample: str, families: OrderedDict[str, _Family]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if sample.endswith(suffix) and sample[: -len(suffix)] in families:
            return sample[: -len(suffix)]
    return sample


def _with_replica(labels: str, replica: str) -> str:
    rep = f'replica="{replica}"'
    return f"{labels},{rep}" if labels else rep


def _num(v: float) -> str:
    return str(int(v)) if math.isfinite(v) and v == int(v) and abs(v) < 2**53 else f"{v:.6g}"
