"""Several sequences generating together: the continuous batching `serve` runs on.

A step is one forward call holding one new token of every decoding sequence and the next prompt span of
every joining one (each block at its own position, in its own KV cache), so each layer's routed experts are
fetched once for the union of what all of them route to and each expert runs once on all the rows routed to
it: prompts that arrive together are prefilled together, beside the decoding rows. A prompt runs in the
spans a lone prompt runs in (the engine's span), so a long one stalls the others a span at a time; the
prompt tokens of one step stay within one span (a joining sequence over it waits a step), so a step's
memory stays what the plan sized. Sequences join and leave at step boundaries; the model computes each block
as it would alone, so a sequence's tokens do not depend on what else shares its steps.

Several choices of one prompt (a request's n) join as a group that takes its slots together: the first one
prefills the prompt, the others wait and then copy its KV cache (a hybrid cache that cannot resume there
prefills the rest itself), and from then on all of them decode in the same steps, each with its own sampler.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moestream.engine.grammar import TokenGrammar
from moestream.engine.prompt_cache import Conversation, PromptCache, common_prefix
from moestream.engine.sampling import Sampler, TokenHistory, TokenLogprobs
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
    history: TokenHistory = field(default_factory=TokenHistory)  # what the sampler's penalties look at
    top_logprobs: int | None = None  # None: no log-probabilities; else the most likely tokens' to report
    fork_of: Sequence | None = None  # the group's first choice, whose prefilled prompt this one copies
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
    logprobs: TokenLogprobs | None = None  # when the sequence asked for them


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
        # running totals for live views (serving/webui.py samples them): tokens stepped, and the last step's rows
        self.prompt_tokens_run = self.decode_tokens_run = self.last_rows = 0

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
        top_logprobs: int | None = None,
        grammar: TokenGrammar | None = None,
    ) -> Sequence:
        """Queue a request; it starts at the next step with a free slot. Raises ContextError if it can't fit.
        stats: the object its stats are kept in (a new one by default); top_logprobs: see Sequence; grammar:
        what its tokens must follow (this sequence's alone: the others in the step are unaffected)."""
        return self.add_choices(
            prompt, max_new_tokens, [sampler or Sampler()], stop_ids, [stats], top_logprobs, [grammar]
        )[0]

    def add_choices(
        self,
        prompt: list[int],
        max_new_tokens: int,
        samplers: list[Sampler],
        stop_ids: set[int] | None = None,
        stats: list[GenerationStats | None] | None = None,
        top_logprobs: int | None = None,
        grammars: list[TokenGrammar | None] | None = None,
    ) -> list[Sequence]:
        """Queue one sequence per sampler on the same prompt, which is prefilled once for all of them; they are
        admitted together, so there must be no more of them than slots. grammars: each choice's own (a
        grammar holds its sequence's place in it)."""
        self.engine.check_prompt(prompt)
        if not 0 < len(samplers) <= self.capacity:
            raise ValueError(f"{len(samplers)} choices of one prompt, but {self.capacity} sequences run at once")
        limit = min(max_new_tokens, self.engine.ctx - len(prompt))
        seqs: list[Sequence] = []
        for i, sampler in enumerate(samplers):
            st = (stats[i] if stats else None) or GenerationStats()
            seq = Sequence(list(prompt), limit, sampler, stop_ids or set(), st, history=TokenHistory(prompt),
                           top_logprobs=top_logprobs, fork_of=seqs[0] if seqs else None,
                           grammar=grammars[i] if grammars else None)  # fmt: skip
            seq.stats.prompt_tokens = len(prompt)
            seqs.append(seq)
        self.waiting.extend(seqs)
        return seqs

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a sequence now (its client went away, or a stop string ended it); the others go on unchanged."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = seq.stats.finish_reason = reason
        elif seq in self.running:
            self._finish(seq, reason)
        self._orphan(seq)

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
            seq = self.waiting[0]
            group = [seq, *(s for s in list(self.waiting)[1:] if s.fork_of is seq)]
            if len(group) > len(self.free):
                return  # a group starts whole, and in its turn
            for s in group:
                self.waiting.remove(s)
                # the free slot holding the longest prefix of this prompt (least recently freed among equals)
                conv = max(self.free, key=lambda c: c.shared(s.prompt))
                self.free.remove(conv)
                s.conversation = conv
                s.started = time.perf_counter()
                hook = getattr(self.engine, "route_hook", None)
                if hook is not None and hasattr(hook, "begin_request"):  # recorded routes: the next sample
                    hook.begin_request(conv.kv)
                self.running.append(s)
                if s.fork_of is None:
                    s.pos = s.stats.reused_tokens = conv.resume(s.prompt, self.engine.prompt_cache)
                else:  # it copies its leader's cache once that is prefilled; the slot's conversation is kept
                    if common_prefix(conv.tokens, s.prompt) < len(conv.tokens):
                        conv.save(self.engine.prompt_cache)
                    conv.forget()

    def _orphan(self, seq: Sequence) -> None:
        """A group's leader ended before its followers copied its prompt: the first of them leads the rest."""
        followers = [s for s in [*self.waiting, *self.running] if s.fork_of is seq]
        for s in followers:
            s.fork_of = followers[0] if s is not followers[0] else None

    def _fork(self, leader: Sequence, now: float) -> None:
        """The leader's prompt is prefilled: its followers copy its KV cache and its last logits."""
        followers = [s for s in self.running if s.fork_of is leader]
        if not followers:
            return
        assert leader.conversation is not None
        snap = leader.conversation.kv.snapshot(leader.pos)
        for s in followers:
            assert s.conversation is not None
            s.fork_of = None
            s.pos = s.stats.reused_tokens = s.conversation.kv.restore(snap, leader.pos)
            s.conversation.tokens = list(s.prompt[: s.pos])
            if s.pos == leader.pos:  # else (a recurrent state without a checkpoint there) it prefills the rest
                s.logits, s.decode_started, s.stats.prompt_s = leader.logits, now, now - s.started

    def _blocks(self) -> list[tuple[Sequence, list[int]]]:
        """This step's sequences and their blocks: every decoding one's token, and the next span of each joining
        one (in arrival order) while the step's prompt tokens stay within one span."""
        span, prompt_tokens = self.engine.prompt_span, 0
        out = []
        for s in self.running:
            if s.next_token is not None:
                out.append((s, [s.next_token]))
            elif s.prefilling and s.fork_of is None:
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
                self._fork(s, now)
        rows = sum(decoding)
        if rows:
            self.decode_batch_sizes[rows] += 1
        self.decode_tokens_run += rows
        self.prompt_tokens_run += sum(len(b) for (_, b), d in zip(blocks, decoding, strict=True) if not d)
        self.last_rows = len(blocks)

    def _sample(self) -> list[TokenEvent]:
        events = []
        for s in [s for s in self.running if s.logits is not None]:
            assert s.logits is not None
            logits = s.logits if s.grammar is None else s.grammar.mask(s.logits)
            token, logprobs = s.sampler.pick(logits, s.history, s.top_logprobs)
            s.history.add(token)
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
            events.append(TokenEvent(s, token, reason, logprobs))
        return events

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = seq.stats.finish_reason = reason
        if seq.decode_started:
            seq.stats.decode_s = time.perf_counter() - seq.decode_started
        self.running.remove(seq)
        assert seq.conversation is not None
        self.free.append(seq.conversation)
        self._orphan(seq)
