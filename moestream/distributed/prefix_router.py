"""Which replica a request goes to: the one holding its conversation's prefix, else the least loaded.

The ingress (serve_app.py) reads each request's body and turns it into prefix keys (`prefix_keys`): one hash
per leading run of the chat's messages (or of a completion prompt's 64-character blocks), each covering
everything before it, so that a conversation's next turn, which repeats the earlier messages, shares its
first keys with the turns before. The router (a Ray Serve RequestRouter, run inside the ingress's handle to
the engine replicas) remembers, for the keys of every finished request, the replica that answered it (that
replica's prompt cache now holds the prefix); a request whose longest known key names a live replica goes
there, unless that replica runs `imbalance` more requests than the least loaded one (a prefix is worth less
than a wait behind a whole batch). Everything else goes to the replica running the fewest requests.

A request counts against the replica ranked first for it from the moment it is ranked, not only once it is
sent: Ray Serve ranks requests that arrive together before it sends any of them (it may wait on the replicas'
queue lengths in between), and ranking by sent requests alone would hand them all to the same replica.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MAX_KEYS = 64  # prefix keys per request: the first messages/blocks are what a next turn shares
MAX_ENTRIES = 100_000  # prefix keys remembered (oldest forgotten first)
PROMPT_BLOCK = 64  # characters (or token ids) of a completion prompt per key
DEFAULT_IMBALANCE = 4  # a prefix's replica may run this many more requests than the least loaded one
RANKED_FOR = 60.0  # seconds a ranked request counts against its first choice if it is never sent
ROUTE_KWARG = "route"  # the handle call's keyword argument that carries the keys


def prefix_keys(path: str, body: Any) -> list[str]:
    """The request's prefix keys, shortest prefix first (none for a body that is not a chat or completion:
    the replica answers it with its error)."""
    if not isinstance(body, dict):
        return []
    if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
        # what the chat template renders before the messages: the tools and the template's settings
        head = [body.get("tools"), body.get("tool_choice"), body.get("chat_template_kwargs"),
                body.get("reasoning_effort")]  # fmt: skip
        parts = [_canonical(m) for m in body["messages"][:MAX_KEYS]]
    elif path.endswith("/completions") and "prompt" in body:
        prompt, head = body["prompt"], []
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not isinstance(prompt, (str, list)):
            return []
        parts = [_canonical(prompt[i : i + PROMPT_BLOCK]) for i in range(0, len(prompt), PROMPT_BLOCK)][:MAX_KEYS]
    else:
        return []
    h = hashlib.blake2b(_canonical([body.get("model"), *head]).encode(), digest_size=16)
    keys = []
    for part in parts:
        h.update(part.encode())
        keys.append(h.copy().hexdigest())
    return keys


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve's request router for the engine replicas (request_router_config of the deployment)."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs: Any) -> None:
        self.imbalance = imbalance
        self.owner: OrderedDict[str, ReplicaID] = OrderedDict()  # prefix key -> the replica that holds it
        self.running: dict[ReplicaID, int] = {}  # requests sent and not finished, per replica
        self.keys_of: dict[str, list[str]] = {}  # internal request id -> its keys, until it finishes
        self.held: dict[ReplicaID, int] = {}  # prefix keys each replica holds: ties go to the one with fewest
        # request id -> (its first choice, when it was ranked), until it is sent
        self.ranked: OrderedDict[str, tuple[ReplicaID, float]] = OrderedDict()

    def load_of(self, replica_id: ReplicaID) -> int:
        """Requests a replica runs, plus those ranked to it and not yet sent."""
        return self.running.get(replica_id, 0) + sum(1 for r, _ in self.ranked.values() if r == replica_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks, best first, one replica each: the prefix's replica (when it is not overloaded), then the
        others by the requests they run (Ray Serve takes the first that accepts)."""
        if not candidate_replicas:
            return []

        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        self.ranked.pop(request_id, None)  # ranked again (its first choice was full): count it once
        now = time.monotonic()
        while self.ranked and now - next(iter(self.ranked.values()))[1] > RANKED_FOR:
            self.ranked.popitem(last=False)  # cancelled before it was sent: Ray Serve says nothing of it

        def load(r: RunningReplica) -> tuple[int, int, str]:
            return self.load_of(r.replica_id), self.held.get(r.replica_id, 0), r.replica_id.unique_id

        by_load = sorted(candidate_replicas, key=load)
        keys = (pending_request.kwargs.get(ROUTE_KWARG) if pending_request is not None else None) or []
        if request_id is not None and keys:
            self.keys_of[request_id] = keys
        held = self.holder(keys, {r.replica_id: r for r in candidate_replicas})
        if held is not None:
            if self.load_of(held.replica_id) - self.load_of(by_load[0].replica_id) <= self.imbalance:
                by_load.remove(held)
                by_load.insert(0, held)
        if request_id is not None:
            self.ranked[request_id] = (by_load[0].replica_id, now)
        return [[r] for r in by_load]

    def holder(self, keys: list[str], live: dict[ReplicaID, RunningReplica]) -> RunningReplica | None:
        """The live replica holding the longest of these prefixes."""
        for key in reversed(keys):
            rid = self.owner.get(key)
            if rid is not None and rid in live:
                return live[rid]
        return None

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.running[replica_id] = self.running.get(replica_id, 0) + 1
        # Ray Serve does not say which request it sent: the oldest one ranked to this replica stops counting
        # as ranked (one that went elsewhere stops when it completes)
        sent = next((rid for rid, (r, _) in self.ranked.items() if r == replica_id), None)
        if sent is not None:
            del self.ranked[sent]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self.running.get(replica_id, 0) > 0:
            self.running[replica_id] -= 1
        self.ranked.pop(internal_request_id, None)
        for key in self.keys_of.pop(internal_request_id, []):
            self._forget(key)
            self.owner[key] = replica_id
            self.held[replica_id] = self.held.get(replica_id, 0) + 1
        while len(self.owner) > MAX_ENTRIES:
            self._forget(next(iter(self.owner)))

    def _forget(self, key: str) -> None:
        rid = self.owner.pop(key, None)
        if rid is not None:
            self.held[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.running.pop(replica_id, None)
        for rid in [rid for rid, (r, _) in self.ranked.items() if r == replica_id]:
            del self.ranked[rid]
        for key in [k for k, r in self.owner.items() if r == replica_id]:
            self._forget(key)
        self.held.pop(replica_id, None)
