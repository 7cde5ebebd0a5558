"""Conversations kept across requests: an LRU of KV-cache snapshots by token prefix, within a byte budget.

A request that extends an earlier conversation (an agent's next turn, a chat's next message) restores the
longest saved prefix it shares and prefills only the rest. Snapshots copy the cache's rows (and a hybrid
cache's recurrent states at the positions it can resume at), so a restore gives exactly the state a fresh
prefill of those tokens would.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol


class Snapshot(Protocol):
    length: int

    @property
    def nbytes(self) -> int: ...

    def resume_at(self, length: int) -> int: ...


@dataclass
class Hit:
    tokens: tuple[int, ...]
    snapshot: Snapshot
    resume: int  # positions a restore holds


def common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # they differ in length
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, prompt: list[int], limit: int) -> Hit | None:
        """The saved prefix a restore resumes furthest into `prompt` (at most `limit` positions); it becomes
        the most recently used."""
        best: Hit | None = None
        for tokens, snap in self.entries.items():
            resume = snap.resume_at(min(common_prefix(tokens, prompt), limit))
            if resume > 0 and (best is None or resume > best.resume):
                best = Hit(tokens, snap, resume)
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best

    def save(self, tokens: list[int], snap: Snapshot) -> bool:
        """Keep `snap` for `tokens`, evicting least recently used entries to fit; False if it cannot fit at
        all. A saved prefix of `tokens` goes where the new entry resumes as far into it: it would never win."""
        key = tuple(tokens[: snap.length])
        for old in [t for t in self.entries if t == key[: len(t)]]:
            if snap.resume_at(len(old)) >= self.entries[old].resume_at(len(old)):
                self._drop(old)
        if not key or snap.nbytes > self.max_bytes:
            return False
        while self.nbytes + snap.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
        self.entries[key] = snap
        self.nbytes += snap.nbytes
        return True

    def _drop(self, key: tuple[int, ...]) -> None:
        self.nbytes -= self.entries.pop(key).nbytes


@dataclass(eq=False)
class Conversation:
    """A KV cache and the tokens it holds: the engine's own, or one sequence slot of a batch."""

    kv: Any  # a model's KV cache (KVCache, or a hybrid cache with recurrent states)
    tokens: list[int] = field(default_factory=list)

    def resume(self, prompt: list[int], saved: PromptCache | None) -> int:
        """Resume at the longest prefix this prompt shares with what the cache holds or with a saved
        conversation (which it then holds); the length resumed at."""
        limit = len(prompt) - 1  # the last prompt token must run to give logits
        common_len = min(common_prefix(self.tokens, prompt), limit)
        if saved is not None:
            hit = saved.lookup(prompt, limit)
            # the live conversation is saved before a saved one replaces it or this prompt cuts it short
            if hit is not None and hit.resume > self.kv.resumable(common_len):
                self.save(saved)
                resumed = self.kv.restore(hit.snapshot, hit.resume)
                self.tokens = list(prompt[:resumed])
                return resumed
            if common_len < len(self.tokens):
                self.save(saved)
        # A recurrent state can only go back to a checkpoint, so the state says where it really resumes.
        common_len = self.kv.truncate(common_len)
        self.tokens = list(prompt[:common_len])
        return common_len

    def shared(self, prompt: list[int]) -> int:
        """The positions a resume would keep without a saved conversation (choosing among free slots)."""
        return self.kv.resumable(min(common_prefix(self.tokens, prompt), len(prompt) - 1))

    def save(self, saved: PromptCache | None) -> None:
        if saved is not None and self.tokens:
            saved.save(self.tokens, self.kv.snapshot(len(self.tokens)))

    def forget(self) -> None:
        self.tokens = []
        self.kv.truncate(0)
