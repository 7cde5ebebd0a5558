"""The remote expert tier: routed experts partitioned over Ray actors (expert_worker.py) that hold them in
their RAM and compute them; the engine's MoE executor (models/routed.py) sends each layer's rows for those
experts first, computes its own experts meanwhile, then takes each remote expert's outputs and sums them in
its fixed order. Experts no worker holds stream from the local disk as always.

A worker that dies or does not answer within the timeout is dropped: its experts are the disk's again (the
executor computes that layer's part of them locally, from the cache), one line says so, nothing hangs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moestream.distributed.cluster import connect
from moestream.distributed.expert_worker import ExpertWorker
from moestream.errors import MoestreamError
from moestream.streaming.budget import MB

# the most workers one engine starts: more is a typo (each is a process holding part of the model)
MAX_WORKERS = 256
# seconds a layer waits for a worker's outputs before computing them from disk instead
DEFAULT_TIMEOUT_S = 60.0


def partition(
    keys: list[tuple[int, int]], workers: int, slot_nbytes: int, worker_mb: int | None
) -> list[list[tuple[int, int]]]:
    """keys (in the order they should be held: hottest first) dealt round-robin to `workers` shares, each up to
    worker_mb of slots (None: all keys): every slot is the same size, so the shares are balanced by bytes,
    and each layer's experts are spread over all workers, which compute them at once."""
    if worker_mb is None:
        cap = len(keys)
    else:
        cap = worker_mb * MB // slot_nbytes
        if cap < 1:
            raise MoestreamError(
                f"--expert-worker-mb {worker_mb} holds no expert (one takes {slot_nbytes / MB:.1f} MiB); raise it"
            )
    shares: list[list[tuple[int, int]]] = [[] for _ in range(workers)]
    for i, key in enumerate(keys[: cap * workers]):
        shares[i % workers].append(key)
    return shares


@dataclass
class Pending:
    """One layer's calls in flight: (worker, its experts, the Ray object ref) each, and the layer's rows."""

    calls: list[tuple[int, list[int], Any]] = field(default_factory=list)


class RemoteExperts:
    """Which worker holds which (layer, expert), the calls to them, and what happens when one is lost."""

    def __init__(self, ray: Any, actors: list[Any], shares: list[list[tuple[int, int]]], timeout_s: float):
        self.ray, self.actors, self.timeout_s = ray, actors, timeout_s
        self.owner: dict[tuple[int, int], int] = {k: w for w, share in enumerate(shares) for k in share}
        self.alive = [True] * len(actors)
        self.remote_calls = 0
        self.lost_experts = 0

    def held(self, layer: int, ids: list[int]) -> set[int]:
        """Which of ids a live worker holds."""
        owner = self.owner
        return {e for e in ids if (layer, e) in owner}

    def submit(self, layer: int, x: torch.Tensor, runs: dict[int, list[np.ndarray]], single: bool) -> Pending:
        """Send each worker its experts' rows of x (each row once per worker) and return at once."""
        by_worker: dict[int, list[int]] = {}
        for e in runs:
            by_worker.setdefault(self.owner[(layer, e)], []).append(e)
        pending = Pending()
        for w, ids in by_worker.items():
            used = np.unique(np.concatenate([r for e in ids for r in runs[e]]))
            where = np.full(x.shape[0], -1, dtype=np.int64)
            where[used] = np.arange(len(used))
            rows = x[torch.from_numpy(used)].numpy() if len(used) < x.shape[0] else x.numpy()
            if len(used) == x.shape[0]:
                where = np.arange(x.shape[0], dtype=np.int64)
            work = [(e, [where[r] for r in runs[e]]) for e in ids]
            ref = self.actors[w].compute.remote(layer, np.ascontiguousarray(rows), work, single)
            pending.calls.append((w, ids, ref))
            self.remote_calls += 1
        return pending

    def collect(self, layer: int, pending: Pending) -> Iterator[tuple[int, list[torch.Tensor] | None]]:
        """(expert, its outputs per block) for every expert sent; None where its worker was lost (the caller
        computes it locally)."""
        for w, ids, ref in pending.calls:
            try:
                outs = self.ray.get(ref, timeout=self.timeout_s)
            except Exception as exc:  # a dead actor, a timeout, an error inside it: the disk has the experts
                self._lose(w, exc)
                for e in ids:
                    yield e, None
                continue
            for e, ys in zip(ids, outs, strict=True):
                yield e, [torch.from_numpy(np.array(y)) for y in ys]  # Ray's arrays are read-only

    def _lose(self, w: int, exc: BaseException) -> None:
        if not self.alive[w]:
            return
        self.alive[w] = False
        mine = [k for k, o in self.owner.items() if o == w]
        for k in mine:
            del self.owner[k]
        self.lost_experts += len(mine)
        print(
            f"warning: expert worker {w} was lost ({type(exc).__name__}: {last_line(exc)}); its {len(mine)} experts "
            "are read from the local disk from now on",
            file=sys.stderr,
        )
        try:
            self.ray.kill(self.actors[w], no_restart=True)
        except Exception:  # already gone
            pass

    def close(self) -> None:
        for w, actor in enumerate(self.actors):
            if self.alive[w]:
                try:
                    self.ray.kill(actor, no_restart=True)
                except Exception:  # already gone
                    pass
        self.alive = [False] * len(self.actors)


class RemoteProvider:
    """The expert provider a model sees with workers on: the local cache for the experts of this machine, and
    `remote` for those the workers hold (models/routed.py asks it first)."""

    def __init__(self, cache: Any, remote: RemoteExperts):
        self.cache, self.remote = cache, remote

    def fetch_groups(self, layer: int, ids: list[int], admit: bool = True, ordered: bool = False):
        return self.cache.fetch_groups(layer, ids, admit, ordered)


def last_line(exc: BaseException) -> str:
    """The line of a Ray error that names the cause (its last: Ray puts the remote traceback first)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def check_workers(workers: int) -> None:
    if not 1 <= workers <= MAX_WORKERS:
        raise MoestreamError(f"--expert-workers must be from 1 to {MAX_WORKERS}, got {workers}")


def start_workers(
    address: str,
    model_path: str,
    exact: bool,
    keys: list[tuple[int, int]],
    slot_nbytes: int,
    workers: int,
    worker_mb: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RemoteExperts:
    """Start `workers` actors on the cluster at `address`, spread over its nodes, each loading its share of
    keys from model_path; returns once all hold their experts."""
    check_workers(workers)
    if workers > len(keys):
        raise MoestreamError(f"--expert-workers {workers} is more than the model's {len(keys)} routed experts")
    shares = partition(keys, workers, slot_nbytes, worker_mb)
    ray = connect(address)
    cls = ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy="SPREAD")(ExpertWorker)
    actors = [cls.remote(model_path, exact, share) for share in shares]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=max(timeout_s, 600.0))
    except Exception as exc:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise MoestreamError(
            f"the expert workers could not load their experts ({last_line(exc)}); every machine of the cluster "
            f"needs the model file at {model_path}"
        ) from None
    return RemoteExperts(ray, actors, shares, timeout_s)


def open_remote(file: Any, cache: Any, options: Any, model_path: str, model: Any) -> RemoteProvider:
    """The engine's provider with the workers the options ask for: every routed expert not pinned locally, in
    layer order, dealt to the workers (up to --expert-worker-mb each; the rest stream from this disk)."""
    cfg = file.cfg
    if own_activation(model):
        raise MoestreamError(
            "--expert-workers does not take experts with their own activation yet (GPT-OSS's clamped, "
            "DeepSeek-V4's clipped SwiGLU: their biases and limits stay on this machine); run it without --ray"
        )
    local = set(cache.policy.profile)
    keys = [(layer, e) for layer in range(cfg.n_layers) for e in range(cfg.n_experts) if (layer, e) not in local]
    remote = start_workers(options.ray_address, model_path, file.exact, keys, file.store.slot_nbytes,
                           options.expert_workers, options.expert_worker_mb, options.expert_timeout_s)  # fmt: skip
    # the prompt read-ahead reads the next layer's uncached experts: those the workers hold would be wasted
    cache.read_ahead = False
    return RemoteProvider(cache, remote)


def own_activation(model: Any) -> bool:
    """Whether any MoE block of the model runs its experts with an activation of its own (MoE.ffn), which the
    workers do not compute: the executor would keep every expert local, and --expert-workers do nothing."""
    from moestream.models.moe import MoE

    stack, seen = [model], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, MoE):
            if obj.ffn is not None:
                return True
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("moestream.models") and hasattr(obj, "__dict__"):
            stack.extend(v for v in vars(obj).values() if not isinstance(v, (torch.Tensor, np.ndarray)))
    return False
