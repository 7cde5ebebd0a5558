"""A routing model: routes for shapes without per-token traces, fitted to real routing.

What an expert cache sees of routing is, per layer, how far back each expert was last used: a token that
reuses its predecessor's experts hits in any cache, one that returns to an expert used 30 tokens ago hits
only in a cache that kept it. The model keeps, per layer:
* `recency`: the distribution of each routed expert's recency rank within its sample (rank 0: the expert of
  the layer used most recently; ranks below top_k are the previous token's experts, the measured reuse
  between consecutive tokens), with one more bin for an expert not used yet in the sample;
* `popularity`: each expert's share of the layer's activations, which picks the experts a sample has not
  used yet;
* `pairs`: co-activation (experts chosen together more often than their popularity says, by lift), which
  weights those picks towards the experts the token already chose.

Reuse is not independent from layer to layer: a token that repeats its predecessor's experts in one layer
tends to repeat them in the others, and a new one brings new experts to most layers at once. A cache shared
by all layers (the engine's) sees that: the experts a token brings in across all its layers are what pushes
an older one out. So every token has a class, its reuse over all layers (the share of its layers' experts
its predecessor used in the same layer), cut at the quantiles into `classes` bands, and `recency` is kept
per class and layer ([class][layer][rank]); `class_reuse` is each class's mean reuse.

A generated token draws its class from the classes' shares (consecutive classes are nearly independent in
real routing), then per layer a rank for each slot from its class's distribution, among the ranks the token
has not taken yet (a token's experts are distinct; the weights are adjusted so that the ranks drawn this way
come out distributed as measured), and takes the expert at that rank of its layer's recency list, or, for a
new one, draws it from popularity times lift. Samples are generated independently, each from an empty
recency list, as the real samples start.

To another shape (`gen --shape`): layer l takes fitted layer l * L_fit // L; ranks scale with the expert
count; popularity is the fitted curve of shares resampled to the new count, on a random order of the ids;
co-activation is kept only at the fitted expert count.
"""

from __future__ import annotations

import json

import numpy as np

from moestream.analysis.route_files import RouteSample, RouteSet
from moestream.errors import MoestreamError

VERSION = 2
MAX_PAIRS = 256  # per layer: the strongest co-activations carry what the weighting needs
CLASSES = 4  # bands of a token's reuse: enough to carry how reuse moves all layers together


def recency_ranks(routes: np.ndarray, n_experts: int) -> np.ndarray:
    """Each access's rank [tokens, top_k] in one layer's recency list (n_experts: not used yet). The list is
    the previous token's experts in slot order, then the ones before them, as the generator keeps it."""
    order: list[int] = []
    out = np.empty(routes.shape, np.int64)
    for t, row in enumerate(routes.tolist()):
        pos = {e: i for i, e in enumerate(order)}
        out[t] = [pos.get(e, n_experts) for e in row]
        order = row + [e for e in order if e not in row]
    return out


def _pairs(routes: np.ndarray, n_experts: int) -> list[list[float]]:
    """[i, j, lift] for the layer's strongest co-activations (lift >= 1.5, seen 5 times or more)."""
    T = len(routes)
    onehot = np.zeros((T, n_experts), np.float32)
    np.put_along_axis(onehot, routes.astype(np.int64), 1.0, axis=1)
    both = onehot.T @ onehot
    p = onehot.mean(0)
    lift = both / T / np.maximum(np.outer(p, p), 1e-12)
    i, j = np.triu_indices(n_experts, 1)
    keep = (both[i, j] >= 5) & (lift[i, j] >= 1.5)
    i, j = i[keep], j[keep]
    order = np.argsort(-both[i, j])[:MAX_PAIRS]
    return [[int(a), int(b), round(float(lift[a, b]), 3)] for a, b in zip(i[order], j[order], strict=True)]


def _classes(shares: np.ndarray) -> np.ndarray:
    """Class edges: the quantiles of the tokens' reuse shares (a token's class: how many edges it passes)."""
    if not len(shares):
        return np.zeros(CLASSES - 1)
    return np.quantile(shares, np.arange(1, CLASSES) / CLASSES)


def _fill_empty(recency: np.ndarray) -> None:
    """A class no token fell in (ties at an edge, a tiny source) takes its layer's distribution over all
    classes; a layer with no token after a first one, all new experts."""
    layer_all = recency.sum(0)
    for c, layer in zip(*np.nonzero(recency.sum(-1) == 0), strict=True):
        recency[c, layer] = layer_all[layer]
    recency[recency.sum(-1) == 0, -1] = 1


def fit(rs: RouteSet) -> dict:
    """The model of a route set's decode routing."""
    L, E, k = rs.n_layers, rs.n_experts, rs.top_k
    decodes = [s.decode.astype(np.int64) for s in rs.samples]
    ranks = [np.stack([recency_ranks(d[:, layer], E) for layer in range(L)], 1) for d in decodes]
    # a sample's first token has no predecessor: its experts are all new, as the generator draws them anyway
    shares = [(r[1:] < k).mean((1, 2)) for r in ranks]
    edges = _classes(np.concatenate(shares))
    cls = [np.searchsorted(edges, sh, side="right") for sh in shares]
    recency = np.zeros((CLASSES, L, E + 1))
    counts = np.zeros((L, E), np.int64)
    for d, r, c in zip(decodes, ranks, cls, strict=True):
        for layer in range(L):
            np.add.at(recency[:, layer], (np.repeat(c, k), r[1:, layer].reshape(-1)), 1)
            counts[layer] += np.bincount(d[:, layer].reshape(-1), minlength=E)
    every_cls, every_share = np.concatenate(cls), np.concatenate(shares)
    n_cls = np.bincount(every_cls, minlength=CLASSES) + (not len(every_cls))  # no token: the classes alike
    _fill_empty(recency)
    every = np.concatenate(decodes)
    return {
        "routing_model": VERSION,
        "source": rs.meta.get("source", ""),
        "layers": L,
        "experts": E,
        "top_k": k,
        "samples": len(rs.samples),
        "tokens": rs.decode_tokens,
        "reuse": round(float(every_share.mean()) if len(every_share) else 0.0, 4),
        "classes": (n_cls / n_cls.sum()).round(6).tolist(),
        "class_reuse": [
            round(float(every_share[every_cls == c].mean() if (every_cls == c).any() else 0), 4) for c in range(CLASSES)
        ],
        "recency": (recency / recency.sum(-1, keepdims=True)).round(6).tolist(),
        "popularity": (counts / np.maximum(1, counts.sum(1, keepdims=True))).round(6).tolist(),
        "pairs": [_pairs(every[:, layer], E) for layer in range(L)],
    }


def save_model(model: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(model, f)


def load_model(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError) as exc:
        raise MoestreamError(f"cannot read the routing model {path}: {exc}") from None
    if not isinstance(m, dict) or "routing_model" not in m:
        raise MoestreamError(f"{path} is not a routing model; write one with moestream routes fit")
    if m["routing_model"] != VERSION:
        raise MoestreamError(f"{path} is a routing model of another version; fit it again with moestream routes fit")
    try:
        L, E = int(m["layers"]), int(m["experts"])
        rec, pop = np.asarray(m["recency"], float), np.asarray(m["popularity"], float)
        shares = np.asarray(m["classes"], float)
    except (KeyError, TypeError, ValueError) as exc:
        raise MoestreamError(f"{path}: the routing model is damaged ({exc})") from None
    C = len(shares)
    bad = shares.ndim != 1 or not C or (shares < 0).any() or not shares.sum() > 0
    if bad or rec.shape != (C, L, E + 1) or pop.shape != (L, E) or len(m.get("pairs", [])) != L:
        raise MoestreamError(f"{path}: the routing model's tables do not match its {L} layers x {E} experts")
    return m


# ---- generating --------------------------------------------------------------------------------------


def _draw_ranks(w: np.ndarray, n: int, k: int, rng: np.random.Generator, tries: int = 64) -> np.ndarray:
    """[n, k] ranks, each slot drawn from w among the ranks its token has not taken yet (a real token's ranks
    are distinct experts); the last bin, a new expert, is never taken. A slot draws again while it draws a
    taken rank, which is drawing from w restricted to the others."""
    new = len(w) - 1
    cdf = np.cumsum(w)
    out = np.full((n, k), new, np.int64)
    for i in range(k):
        todo = np.arange(n)
        for _ in range(tries):
            r = np.minimum(np.searchsorted(cdf, rng.random(len(todo)) * cdf[-1], side="right"), new)
            taken = (r[:, None] == out[todo, :i]).any(1) & (r < new)
            out[todo[~taken], i] = r[~taken]
            todo = todo[taken]
            if not len(todo):
                break
        # what still draws taken ranks has (nearly) nothing else left in w: new experts, as out holds
    return out


def _drawing(p: np.ndarray, k: int, rng: np.random.Generator, n: int = 8192, rounds: int = 4) -> np.ndarray:
    """The weights to draw ranks from (_draw_ranks) so that they come out distributed as measured (p): drawn
    with p itself, the slots after the first would take the likeliest ranks, the previous token's experts,
    less often than measured."""
    w = p.copy()
    for _ in range(rounds):
        got = np.bincount(_draw_ranks(w, n, k, rng).reshape(-1), minlength=len(p))
        w = w * np.where(got > 0, p * got.sum() / np.maximum(got, 1), 1)
        w /= w.sum()
    return w


def _rank_draws(rec: np.ndarray, n_experts: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A fitted layer's rank distributions [classes, E_fit + 1] at the target expert count (ranks scaled with
    it), adjusted for drawing at the target top-k (_drawing)."""
    E_fit = rec.shape[1] - 1
    if n_experts != E_fit:
        cdf = np.concatenate([np.zeros((len(rec), 1)), np.cumsum(rec[:, :E_fit], 1)], 1)
        at = np.linspace(0, E_fit, n_experts + 1)
        scaled = np.diff([np.interp(at, np.arange(E_fit + 1), row) for row in cdf], axis=1)
        rec = np.concatenate([scaled, rec[:, E_fit:]], 1)
    return np.array([_drawing(row / row.sum(), k, rng) for row in rec])


class _Layer:
    """One generated layer's tables at the target expert count (draw: its rank distributions, _rank_draws)."""

    def __init__(self, draw: np.ndarray, pop: np.ndarray, pairs: list, n_experts: int, rng: np.random.Generator):
        E_fit = len(pop)
        self.draw, self.n = draw, n_experts
        self.lift: dict[tuple[int, int], float] = {}
        if n_experts == E_fit:
            self.pop = pop
            for i, j, lift in pairs:
                self.lift[(int(i), int(j))] = self.lift[(int(j), int(i))] = float(lift)
        else:  # the fitted shares resampled to the new count, on a random order of the ids
            grid = np.linspace(0, 1, n_experts)
            curve = np.interp(grid, np.linspace(0, 1, E_fit), np.sort(pop)[::-1])
            self.pop = rng.permutation(curve / curve.sum())

    def new_expert(self, unseen: np.ndarray, chosen: list[int], rng: np.random.Generator) -> int:
        w = self.pop * unseen
        w[chosen] = 0
        if not w.any():  # every expert was used already: popularity among those not chosen
            w = self.pop.copy()
            w[chosen] = 0
        if self.lift and chosen:
            for e in np.flatnonzero(w):
                for c in chosen:
                    w[e] *= self.lift.get((c, int(e)), 1.0)
        return int(rng.choice(self.n, p=w / w.sum()))


def _token(lay: _Layer, ranks: np.ndarray, order: list[int], unseen: np.ndarray, rng) -> list[int]:
    """One token's experts in one layer: each slot the expert at its drawn recency rank, else a new one."""
    chosen: list[int] = []
    for r in ranks:
        # the ranks are distinct, but a new expert drawn once every expert was used may sit further down the
        # list: the rank then moves to the next expert down that the token has not chosen
        e = next((e2 for e2 in order[r:] if e2 not in chosen), -1)
        chosen.append(e if e >= 0 else lay.new_expert(unseen, chosen, rng))
    return chosen


def generate(model: dict, lengths: list[int], layers: int = 0, experts: int = 0, top_k: int = 0, seed: int = 0):
    """A RouteSet of len(lengths) samples of those decode tokens at the shape asked for (0: the model's)."""
    L_fit, E_fit = int(model["layers"]), int(model["experts"])
    L, E, k = layers or L_fit, experts or E_fit, top_k or int(model["top_k"])
    if k > E:
        raise MoestreamError(f"top-{k} needs at least {k} experts per layer, the shape has {E}")
    rng = np.random.default_rng(seed)
    rec, pop = np.asarray(model["recency"], float), np.asarray(model["popularity"], float)
    fitted = [layer * L_fit // L for layer in range(L)]
    draws = {li: _rank_draws(rec[:, li], E, k, rng) for li in sorted(set(fitted))}
    lays = [_Layer(draws[li], pop[li], model["pairs"][li], E, rng) for li in fitted]
    shares = np.asarray(model["classes"], float)
    samples = []
    for n in lengths:
        out = np.zeros((n, L, k), np.int16)
        cls = rng.choice(len(shares), size=n, p=shares / shares.sum())  # each token's class, for all its layers
        for layer, lay in enumerate(lays):
            order: list[int] = []  # most recent first
            unseen = np.ones(E)
            ranks = np.zeros((n, k), np.int64)
            for c in range(len(shares)):
                ranks[cls == c] = _draw_ranks(lay.draw[c], int((cls == c).sum()), k, rng)
            for t in range(n):
                chosen = _token(lay, ranks[t], order, unseen, rng)
                out[t, layer] = chosen
                unseen[chosen] = 0
                order = chosen + [e for e in order if e not in chosen]
        samples.append(RouteSample(out, np.zeros((0, L, k), np.int16)))
    return RouteSet(samples, L, E, k, meta={"source": f"routing model {model.get('source', '')}".strip()})
