"""Route files: which experts each token of each sample (one request) routed to, for `--route-trace` and
`moestream replay`.

A route file is a moestream trace (analysis/trace.py) in which every token is its own forward step, so the
replay reads it as it reads any trace and `--route-trace` takes one token's routes from each decode step.
Its metadata keeps the samples apart: `samples` lists each sample's decode tokens and `prompt_tokens` its
prompt tokens (step order: a sample's prompt steps, then its decode steps, then the next sample's), and
`layers`, `experts`, `top_k` give its shape. A trace without `samples` is one sample of decode tokens.

`moestream routes import` reads three kinds of source into a RouteSet and writes it as a route file:
* per-sample arrays: an .npz of int arrays [tokens, layers, top_k] (one per sample) with an optional .json
  beside it listing the samples in order ({"key": ...} each), as the GPT-OSS-20B fingerprinting data is kept;
* "route_trace v1" CSV (`# route_trace v1` header; rows turn,phase,step,layer,slot,expert,...): one sample
  per turn;
* a moestream trace (`--trace`, or a route file): its decode routes.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np

from moestream.analysis.trace import DECODE, HEADER, TRACE_DTYPE, read_trace
from moestream.errors import MoestreamError


@dataclass
class RouteSample:
    decode: np.ndarray  # int16 [tokens, layers, top_k]: the experts each generated token routed to
    # int16 [tokens, layers, top_k]: the prompt's, where the source has them (else 0 tokens); -1 where a layer
    # did not route a token (llama.cpp skips the last layer for all prompt tokens but the last)
    prompt: np.ndarray


@dataclass
class RouteSet:
    samples: list[RouteSample]
    n_layers: int
    n_experts: int
    top_k: int
    expert_bytes: int = 0  # bytes one expert reads, where the source says (0: unknown)
    meta: dict = field(default_factory=dict)
    experts_known: bool = True  # False: the source does not say, n_experts is its highest id + 1

    @property
    def shape(self) -> str:
        return shape_text(self.n_layers, self.n_experts, self.top_k)

    @property
    def decode_tokens(self) -> int:
        return sum(len(s.decode) for s in self.samples)


def shape_text(layers: int, experts: int, top_k: int) -> str:
    return f"{layers} layers x {experts} experts, top-{top_k}"


def check_shape(rs: RouteSet, what: str, layers: int, experts: int, top_k: int, model: str) -> None:
    """Refuse routes another shape than the model's: the same experts and top-k, and at least its layers
    (a shallower model, `synth --layers N`, takes the first N layers' routes)."""
    wrong = rs.n_experts != experts if rs.experts_known else rs.n_experts > experts
    if wrong or rs.top_k != top_k or rs.n_layers < layers:
        raise MoestreamError(
            f"{what} has routes for {rs.shape} but the model {model} is {shape_text(layers, experts, top_k)}; "
            "import routes of the model's shape (moestream synth --top-k N writes a model at another top-k)"
        )


def _check_ids(routes: np.ndarray, n_experts: int, where: str) -> None:
    routes = routes[(routes >= 0).all(-1)]
    if routes.size and (routes.min() < 0 or routes.max() >= n_experts):
        bad = int(routes.max() if routes.max() >= n_experts else routes.min())
        raise MoestreamError(f"{where} routes to expert {bad}, outside 0..{n_experts - 1}; is it damaged?")
    if routes.size and routes.shape[-1] > 1:
        s = np.sort(routes.reshape(-1, routes.shape[-1]), axis=1)
        if (s[:, 1:] == s[:, :-1]).any():
            raise MoestreamError(f"{where} repeats an expert within one token's layer; is it damaged?")


def _finish(samples: list[RouteSample], path: str, n_experts: int | None, meta: dict, nbytes: int = 0) -> RouteSet:
    samples = [s for s in samples if len(s.decode)]
    if not samples:
        raise MoestreamError(f"{path} holds no decode tokens to take routes from")
    _, n_layers, top_k = samples[0].decode.shape
    for i, s in enumerate(samples):
        for part in (s.decode, s.prompt):
            if part.ndim != 3 or (len(part) and part.shape[1:] != (n_layers, top_k)):
                raise MoestreamError(
                    f"{path}: sample {i} is shaped {list(part.shape)}, the first {[n_layers, top_k]} per token; "
                    "every sample must route the same layers and top-k"
                )
    known = bool(n_experts)
    n_experts = n_experts or max(int(s.decode.max()) for s in samples) + 1
    for i, s in enumerate(samples):
        _check_ids(np.concatenate([s.prompt, s.decode]), n_experts, f"{path} (sample {i})")
    return RouteSet(samples, n_layers, n_experts, top_k, nbytes, meta, known)


# ---- readers ------------------------------------------------------------------------------------------


def read_routes(path: str, n_experts: int | None = None) -> RouteSet:
    """Any supported source, told apart by its content. n_experts: the experts per layer where the source
    does not say (default: its highest id + 1)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise MoestreamError(f"cannot read {path}: {exc.strerror}; check the path") from None
    if not head:
        raise MoestreamError(f"{path} is empty")
    if head.startswith(b"PK"):
        return read_npz(path, n_experts)
    if head.startswith(b"# route_trace v1"):
        return read_route_csv(path)
    return read_moestream_trace(path, n_experts)


def _npz_keys(path: str, keys: list[str]) -> list[str]:
    """The samples in the order the .json beside the .npz lists them (else the archive's)."""
    side = os.path.splitext(path)[0] + ".json"
    if not os.path.exists(side):
        return keys
    try:
        with open(side, encoding="utf-8") as f:
            listed = [e["key"] for e in json.load(f)]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise MoestreamError(f"{side} does not list the samples as [{{'key': ...}}, ...]: {exc}") from None
    missing = [k for k in listed if k not in keys]
    if missing:
        raise MoestreamError(f"{side} lists {missing[0]}, which {path} does not hold")
    return listed


def read_npz(path: str, n_experts: int | None = None) -> RouteSet:
    samples = []
    try:
        with np.load(path, allow_pickle=False) as z:
            for key in _npz_keys(path, list(z.keys())):
                a = z[key]
                if a.ndim != 3 or not np.issubdtype(a.dtype, np.integer):
                    raise MoestreamError(
                        f"{path}: {key} is {a.dtype} {list(a.shape)}; each sample must be integers "
                        "[tokens, layers, top_k]"
                    )
                samples.append(RouteSample(a.astype(np.int16), np.zeros((0, *a.shape[1:]), np.int16)))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise MoestreamError(f"cannot read {path} as per-sample arrays: {exc}; is it cut off?") from None
    return _finish(samples, path, n_experts, {"source": os.path.basename(path)})


def _csv_head(path: str, lines: list[str]) -> tuple[dict[str, int], int, int]:
    """The model line's n_layer, n_expert, n_expert_used; the expert bytes; where the rows start."""
    info: dict[str, int] = {}
    nbytes, i = 0, 0
    while i < len(lines) and lines[i].startswith("#"):
        for word in lines[i][1:].split():
            k, _, v = word.partition("=")
            if k in ("n_layer", "n_expert", "n_expert_used") or (k == "expert_bytes" and not nbytes):
                try:
                    info[k] = int(v)
                except ValueError:
                    raise MoestreamError(f"{path}: line {i + 1} has {word!r}, not a number") from None
        i += 1
    nbytes = info.pop("expert_bytes", 0)
    if set(info) != {"n_layer", "n_expert", "n_expert_used"}:
        raise MoestreamError(f"{path}: the header names no n_layer, n_expert and n_expert_used; is it a route_trace?")
    return info, nbytes, i


def read_route_csv(path: str) -> RouteSet:
    """'route_trace v1': one sample per turn, each token a step with its layers' experts by slot."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise MoestreamError(f"cannot read {path}: {exc.strerror}") from None
    info, nbytes, i = _csv_head(path, lines)
    L, E, k = info["n_layer"], info["n_expert"], info["n_expert_used"]
    if i >= len(lines) or not lines[i].startswith("turn,phase,step,layer,slot,expert"):
        raise MoestreamError(f"{path}: no 'turn,phase,step,layer,slot,expert,...' column line")
    rows = [ln.split(",")[:6] for ln in lines[i + 1 :] if ln.strip()]
    try:
        a = np.array(rows, dtype=np.int64)
    except ValueError:
        raise MoestreamError(f"{path}: a row does not parse as whole numbers; is it damaged or cut off?") from None
    if a.ndim != 2 or a.shape[1] != 6:
        raise MoestreamError(f"{path}: rows must hold turn,phase,step,layer,slot,expert; is it cut off?")
    samples = []
    for turn in np.unique(a[:, 0]):
        t = a[a[:, 0] == turn]
        parts = [_csv_phase(path, t[t[:, 1] == ph], L, k, int(turn), ph == 1) for ph in (0, 1)]
        samples.append(RouteSample(parts[1], parts[0]))
    return _finish(samples, path, E, {"source": os.path.basename(path)}, nbytes)


def fill_routes(step: np.ndarray, layer: np.ndarray, rank: np.ndarray, expert: np.ndarray, L: int, k: int):
    """[tokens, L, k] from rows (one token per distinct step, in step order), -1 where no row is; None if a
    row is out of that shape or two rows fill one place."""
    steps, idx = np.unique(step, return_inverse=True)
    if len(layer) and (layer.min() < 0 or layer.max() >= L or rank.min() < 0 or rank.max() >= k):
        return None
    flat = (idx * L + layer) * k + rank
    if len(np.unique(flat)) != len(flat):
        return None
    out = np.full(len(steps) * L * k, -1, np.int64)
    out[flat] = expert
    return out.reshape(len(steps), L, k)


def _csv_phase(path: str, t: np.ndarray, L: int, k: int, turn: int, decode: bool) -> np.ndarray:
    routes = fill_routes(t[:, 2], t[:, 3], t[:, 4], t[:, 5], L, k)
    # a prompt token may lack whole layers (see RouteSample); a decode token routes every slot of every layer
    full = (routes >= 0).all(-1) if routes is not None else None
    partial = full is not None and (full.any(-1) if not decode else full.all(-1)).all()
    if routes is None or not partial or ((routes >= 0).any(-1) != full).any():
        what = "decode" if decode else "prompt"
        raise MoestreamError(
            f"{path}: turn {turn}'s {what} tokens do not each hold {k} experts for each of {L} layers; "
            "is it cut off or damaged?"
        )
    return routes.astype(np.int16)


def read_moestream_trace(path: str, n_experts: int | None = None) -> RouteSet:
    """A moestream trace's decode routes; a route file's samples and prompts as it keeps them."""
    meta, rows = read_trace(path)
    if "samples" not in meta:  # a recorded trace: its decode steps (a prompt step is a span's union), one sample
        rows = rows[rows["phase"] == DECODE]
    if not len(rows):
        raise MoestreamError(f"{path} has no decode accesses to take routes from; record one with --trace")
    L = int(meta.get("layers") or 0) or int(rows["layer"].max()) + 1
    counts = np.unique(rows["step"] * L + rows["layer"], return_counts=True)[1]
    k = int(meta.get("top_k") or 0) or int(counts.max())
    routes = fill_routes(rows["step"], rows["layer"], rows["rank"], rows["expert"], L, k)
    dec = np.unique(rows["step"], return_index=True)[1]
    dec = rows["phase"][dec] == DECODE
    if routes is None or not (routes[dec] >= 0).all() or ((routes >= 0).any(-1) != (routes >= 0).all(-1)).any():
        raise MoestreamError(
            f"{path} does not hold {k} experts for every layer of every decode token; is it cut off or damaged?"
        )
    routes = routes.astype(np.int16)
    decode_n = [int(n) for n in meta.get("samples", [len(routes)])]
    prompt_n = [int(n) for n in meta.get("prompt_tokens", [0] * len(decode_n))]
    if len(prompt_n) != len(decode_n) or sum(decode_n) + sum(prompt_n) != len(routes):
        n = sum(decode_n) + sum(prompt_n)
        raise MoestreamError(f"{path}: its samples count {n} tokens but it holds {len(routes)}; is it cut off?")
    samples, at = [], 0
    for p, d in zip(prompt_n, decode_n, strict=True):
        samples.append(RouteSample(routes[at + p : at + p + d], routes[at : at + p]))
        at += p + d
    n_experts = n_experts or int(meta.get("experts") or 0) or None
    return _finish(samples, path, n_experts, {"source": os.path.basename(path)}, int(meta.get("expert_bytes") or 0))


# ---- the route file -----------------------------------------------------------------------------------


def route_rows(rs: RouteSet) -> np.ndarray:
    """The route file's rows (TRACE_DTYPE): each token its own step, its layers' experts in router order."""
    L, k = rs.n_layers, rs.top_k
    parts, step = [], 0
    for s in rs.samples:
        for phase, routes in ((0, s.prompt), (DECODE, s.decode)):
            n = len(routes)
            if not n:
                continue
            r = np.zeros(n * L * k, TRACE_DTYPE)
            tok = np.repeat(np.arange(n), L * k)
            r["token"] = tok + (len(s.prompt) if phase == DECODE else 0)
            r["phase"] = phase
            r["step"] = step + tok
            r["layer"] = np.tile(np.repeat(np.arange(L), k), n)
            r["expert"] = routes.reshape(-1)
            r["rank"] = np.tile(np.arange(k), n * L)
            r["source"] = 2
            parts.append(r[r["expert"] >= 0])
            step += n
    return np.concatenate(parts)


def route_meta(rs: RouteSet) -> dict:
    return {
        "route_file": 1,
        "source": rs.meta.get("source", ""),
        "layers": rs.n_layers,
        "experts": rs.n_experts,
        "top_k": rs.top_k,
        "expert_bytes": rs.expert_bytes,
        "samples": [len(s.decode) for s in rs.samples],
        "prompt_tokens": [len(s.prompt) for s in rs.samples],
    }


def write_routes(rs: RouteSet, path: str) -> int:
    """Write the route file; returns its rows."""
    rows = route_rows(rs)
    phase = np.array(["prompt", "decode"])[rows["phase"]]
    cols = [rows["token"], phase, rows["step"], rows["layer"], rows["expert"], rows["rank"]]
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("# moestream-trace: 1\n")
        for key, value in route_meta(rs).items():
            f.write(f"# {key}: {json.dumps(value)}\n")
        f.write(HEADER + "\n")
        for a in range(0, len(rows), 1 << 18):  # in chunks: a big source is millions of rows
            chunk = [c[a : a + (1 << 18)].tolist() for c in cols]
            f.write("".join(f"{t},{p},{s},{la},{e},{r},disk,0,0\n" for t, p, s, la, e, r in zip(*chunk, strict=True)))
    return len(rows)
