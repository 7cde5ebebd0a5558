"""Several sequences generating together: the continuous batching `serve` runs on.

A step is one forward call holding one new token of every decoding sequence and the next prompt span of
every joining one (each block at its own position, in its own KV cache), so each layer's routed experts are
fetched once for the union of what all of them route to and each expert runs once on all the rows routed to
it: prompts that arrive together are prefilled together, beside the decoding rows. A prompt runs in the
spans a lone prompt runs in (the engine's span), so a long one stalls the others a span at a time; the
prompt tokens of one step stay within one span (a joining sequence over it waits a step), so a step's
memory stays what the plan sized. Sequences join and leave at step boundaries; the model computes each block
as it would alone, so a sequence's tokens do not depend on what else shares its steps.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moestream.engine.grammar import TokenGrammar
from moestream.engine.prompt_cache import Conversation, PromptCache
from moestream.engine.sampling import Sampler
from moestream.engine.stats import GenerationStats


class SchedulerEngine(Protocol):
    """What a batch needs of the engine (engine.Engine): its slots' KV caches, its prompt cache and forwards."""

    ctx: int
    prompt_span: int
    cache: Any  # the expert cache: phase and generation()
    conversation: Conversation
    batch_kvs: list[Any]
    prompt_cache: PromptCache | None

    def check_prompt(self, prompt: list[int]) -> None: ...

    def step(self, blocks: list[list[int]], kvs: list[Any], positions: list[int], prompt: bool) -> torch.Tensor: ...


@dataclass(eq=False)
class Sequence:
    """One request in a batch: its prompt, how it samples and stops, and where it stands."""

    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    stop_ids: set[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    conversation: Conversation | None = None  # its KV cache, once admitted
    pos: int = 0  # positions its KV cache holds
    logits: torch.Tensor | None = None  # of its last position, not yet sampled
    next_token: int | None = None  # sampled, to run at the next step
    n_new: int = 0
    finish_reason: str | None = None  # stop | length | cancelled, once finished
    started: float = 0.0  # when it was admitted
    decode_started: float = 0.0
    grammar: TokenGrammar | None = None  # structured output: masks its logits, ends it when complete

    @property
    def prefilling(self) -> bool:
        return self.conversation is not None and self.pos < len(self.prompt)


@dataclass
class TokenEvent:
    """A token a sequence generated; finish_reason is set on its last one."""

    sequence: Sequence
    token: int
    finish_reason: str | None = None


class Scheduler:
    """The sequences of one engine that generate together; `step()` advances all of them by one token."""

    def __init__(self, engine: SchedulerEngine, slots: list[Conversation] | None = None):
        """slots: the conversations sequences run in (default: the engine's own and one per batch KV cache).
        Every slot keeps its conversation after the request ends, so a request that extends it (a chat's next
        turn) lands on that slot and prefills only its new tokens."""
        self.engine = engine
        if slots is None:
            slots = [engine.conversation, *(Conversation(kv) for kv in engine.batch_kvs)]
        self.free: list[Conversation] = list(slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.decode_batch_sizes: Counter[int] = Counter()  # decode steps by the rows they ran

    @property
    def capacity(self) -> int:
        return len(self.free) + len(self.running)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_ids: set[int] | None = None,
        stats: GenerationStats | None = None,
        grammar: TokenGrammar | None = None,
    ) -> Sequence:
        """Queue a request; it starts at the next step with a free slot. Raises ContextError if it can't fit.
        stats: the object its stats are kept in (a new one by default); grammar: what its tokens must
        follow (this sequence's alone: the others in the step are unaffected)."""
        self.engine.check_prompt(prompt)
        seq = Sequence(list(prompt), min(max_new_tokens, self.engine.ctx - len(prompt)), sampler or Sampler(),
                       stop_ids or set(), stats or GenerationStats())  # fmt: skip
        seq.stats.prompt_tokens = len(prompt)
        seq.grammar = grammar
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a sequence now (its client went away, or a stop string ended it); the others go on unchanged."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = seq.stats.finish_reason = reason
        elif seq in self.running:
            self._finish(seq, reason)

    def fail_running(self) -> list[Sequence]:
        """After a step raised: end every admitted sequence, forgetting its KV cache (a forward pass that died
        half-way may have left it inconsistent); the waiting ones stay queued. The sequences ended."""
        failed = list(self.running)
        for seq in failed:
            self._finish(seq, "cancelled")
            assert seq.conversation is not None
            seq.conversation.forget()
        return failed

    def step(self) -> list[TokenEvent]:
        """Admit waiting sequences into free slots, run one step (a token of every decoding sequence, a prompt
        span of every joining one), then sample: the tokens this step generated."""
        self._admit()
        if not self.running:
            return []
        with torch.inference_mode(), self.engine.cache.generation():
            self._run()
        return self._sample()

    # -- the parts of a step ----------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            # the free slot holding the longest prefix of this prompt (least recently freed among equals)
            conv = max(self.free, key=lambda c: c.shared(seq.prompt))
            self.free.remove(conv)
            seq.conversation = conv
            seq.pos = seq.stats.reused_tokens = conv.resume(seq.prompt, self.engine.prompt_cache)
            seq.started = time.perf_counter()
            self.running.append(seq)

    def _blocks(self) -> list[tuple[Sequence, list[int]]]:
        """This step's sequences and their blocks: every decoding one's token, and the next span of each joining
        one (in arrival order) while the step's prompt tokens stay within one span."""
        span, prompt_tokens = self.engine.prompt_span, 0
        out = []
        for s in self.running:
            if s.next_token is not None:
                out.append((s, [s.next_token]))
            elif s.prefilling:
                chunk = s.prompt[s.pos : s.pos + span]
                if prompt_tokens and prompt_tokens + len(chunk) > span:
                    continue
                prompt_tokens += len(chunk)
                out.append((s, chunk))
        return out

    def _run(self) -> None:
        blocks = self._blocks()
        if not blocks:
            return
        decoding = [s.next_token is not None for s, _ in blocks]
        convs = [s.conversation for s, _ in blocks]
        assert all(c is not None for c in convs)
        logits = self.engine.step(
            [b for _, b in blocks],
            [c.kv for c in convs],  # type: ignore[union-attr]
            [s.pos for s, _ in blocks],
            prompt=not all(decoding),
        )
        now = time.perf_counter()
        for i, ((s, block), conv) in enumerate(zip(blocks, convs, strict=True)):
            conv.tokens.extend(block)  # type: ignore[union-attr]
            s.pos += len(block)
            if decoding[i]:
                s.logits, s.next_token = logits[i], None
            elif not s.prefilling:
                s.logits = logits[i]
                s.decode_started = now
                s.stats.prompt_s = now - s.started
        if any(decoding):
            self.decode_batch_sizes[sum(decoding)] += 1

    def _sample(self) -> list[TokenEvent]:
        events = []
        for s in [s for s in self.running if s.logits is not None]:
            assert s.logits is not None
            token = s.sampler(s.logits if s.grammar is None else s.grammar.mask(s.logits))
            s.logits = None
            if s.grammar is not None:
                s.grammar.accept(token)
            s.n_new += 1
            st = s.stats
            st.decode_tokens, st.decode_s = s.n_new, time.perf_counter() - s.decode_started
            done = token in s.stop_ids or (s.grammar is not None and s.grammar.done)
            reason = "stop" if done else "length" if s.n_new >= s.max_new_tokens else None
            if reason is None:
                s.next_token = token
            else:
                self._finish(s, reason)
            events.append(TokenEvent(s, token, reason))
        return events

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = seq.stats.finish_reason = reason
        if seq.decode_started:
            seq.stats.decode_s = time.perf_counter() - seq.decode_started
        self.running.remove(seq)
        assert seq.conversation is not None
        self.free.append(seq.conversation)
